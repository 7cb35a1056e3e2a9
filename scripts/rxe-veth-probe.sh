#!/bin/sh
# Probe (run in the verbs lab's guest: scripts/rdma-lab run -- sh
# scripts/rxe-veth-probe.sh): can two network namespaces, joined by a veth,
# each have an rxe device that carries RC traffic between them? On Debian's
# 6.1 kernel the devices and their GIDs appear, but ibv_rc_pingpong fails
# with "local QP operation error": rxe's UDP socket and route lookups live
# in the initial namespace only. Exit status: the pingpong's.
set -x
uname -r
ip netns add xa; ip netns add xb
ip link add va type veth peer name vb
ip link set va netns xa; ip link set vb netns xb
ip -n xa addr add 10.77.0.1/24 dev va; ip -n xb addr add 10.77.0.2/24 dev vb
ip -n xa link set va up; ip -n xb link set vb up; ip -n xa link set lo up; ip -n xb link set lo up
ip netns exec xa rdma link add rxe_a type rxe netdev va; echo "add a rc=$?"
ip netns exec xb rdma link add rxe_b type rxe netdev vb; echo "add b rc=$?"
rdma link; ip netns exec xa rdma link
sleep 2
ls /sys/class/infiniband/
for d in rxe_a rxe_b; do for i in 0 1 2; do echo "$d gid$i $(cat /sys/class/infiniband/$d/ports/1/gids/$i 2>/dev/null) $(cat /sys/class/infiniband/$d/ports/1/gid_attrs/types/$i 2>/dev/null)"; done; done
(ip netns exec xa timeout 20 ibv_rc_pingpong -d rxe_a -g 1 -n 100 > /tmp/pp-a.log 2>&1 &) 
sleep 1
ip netns exec xb timeout 20 ibv_rc_pingpong -d rxe_b -g 1 -n 100 10.77.0.1
rc=$?
echo "pingpong rc=$rc"
sleep 1; cat /tmp/pp-a.log
exit $rc
