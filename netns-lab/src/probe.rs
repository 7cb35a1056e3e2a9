//! Helpers of the hostile-peer tests (rule 9) that every backend's tests
//! need: a connection from an attacker's own loopback address, and this
//! process's memory as `/proc` reports it.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

/// How long [`connect_from`] waits for the connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// A TCP connection to `dst` from the loopback address `src` (Linux routes
/// all of 127.0.0.0/8 to lo): an attacker's own address, so that per-address
/// caps tell it apart from the honest peers on 127.0.0.1. Bounded by
/// [`CONNECT_TIMEOUT`].
pub fn connect_from(src: Ipv4Addr, dst: SocketAddr) -> std::io::Result<TcpStream> {
    connect_from_timeout(src, dst, CONNECT_TIMEOUT)
}

/// [`connect_from`] bounded by `timeout` (a non-blocking connect and a
/// poll); the stream it returns blocks.
pub fn connect_from_timeout(src: Ipv4Addr, dst: SocketAddr, timeout: Duration) -> std::io::Result<TcpStream> {
    use std::os::fd::{AsRawFd, FromRawFd};
    let SocketAddr::V4(dst) = dst else { return Err(std::io::ErrorKind::Unsupported.into()) };
    let sin = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr { s_addr: u32::from(ip).to_be() },
        sin_zero: [0; 8],
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor this function owns (the
    // TcpStream takes it at once and closes it on every path); the
    // addresses are valid `sockaddr_in`s of the length passed; poll gets
    // one valid pollfd.
    let s = unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = TcpStream::from_raw_fd(fd);
        let local = sin(src, 0);
        if libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let remote = sin(*dst.ip(), dst.port());
        if libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::EINPROGRESS) {
                return Err(e);
            }
            let mut p = libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
            let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
            let n = libc::poll(&mut p, 1, ms);
            if n == 0 {
                return Err(std::io::ErrorKind::TimedOut.into());
            }
            if n < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
        s
    };
    if let Some(e) = s.take_error()? {
        return Err(e);
    }
    s.set_nonblocking(false)?;
    Ok(s)
}

/// A field of `/proc/self/status` in its own unit (KiB for `VmRSS:` and
/// `VmHWM:`, a count for `Threads:`); 0 where it cannot be read.
pub fn proc_status(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines().find_map(|l| l.strip_prefix(field)).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// This process's resident set, in KiB.
pub fn rss_kib() -> u64 {
    proc_status("VmRSS:")
}
