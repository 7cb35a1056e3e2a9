//! One error per verbs operation: which call failed and why.

/// What went wrong in a verbs call.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum VerbsError {
    /// The device list could not be read, or has no device of that name. On
    /// a machine without a verbs stack (this project's development hosts)
    /// the list itself fails: run the verbs tests in the lab guest
    /// (`scripts/rdma-lab test`).
    #[error("no verbs device {name:?} here ({why}); the verbs tests run in the lab guest: scripts/rdma-lab test")]
    NoDevice {
        /// The device asked for.
        name: String,
        /// What the device list said.
        why: String,
    },
    /// A libibverbs call failed with an OS error.
    #[error("{op}: {source}")]
    Os {
        /// The call.
        op: &'static str,
        /// Its error.
        #[source]
        source: std::io::Error,
    },
    /// A call's arguments were refused before reaching the device (bounds,
    /// a window in the wrong state, a region without a host pointer).
    #[error("{op}: {what}")]
    Invalid {
        /// The call.
        op: &'static str,
        /// Why.
        what: String,
    },
    /// A connection descriptor from the side channel did not decode.
    #[error("bad endpoint descriptor: {0}")]
    Endpoint(String),
    /// Device memory this NIC cannot register: the region exports no dma-buf
    /// (core's fake device), or the driver, kernel or NIC refuses GPUDirect
    /// RDMA through one (`ibv_reg_dmabuf_mr`).
    #[error("device memory cannot be registered for RDMA: {why}")]
    DeviceMemory {
        /// Why.
        why: String,
    },
}

impl VerbsError {
    /// The OS error of the last call (libibverbs sets `errno`), or `ret` as
    /// an errno where the call returns it instead.
    #[cfg_attr(not(feature = "verbs"), allow(dead_code))]
    pub(crate) fn os(op: &'static str, ret: i32) -> Self {
        let source = if ret > 0 { std::io::Error::from_raw_os_error(ret) } else { std::io::Error::last_os_error() };
        Self::Os { op, source }
    }

    pub(crate) fn invalid(op: &'static str, what: impl Into<String>) -> Self {
        Self::Invalid { op, what: what.into() }
    }
}
