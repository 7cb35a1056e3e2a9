//! Which memory a pool's slots live in, as a command line or a config names it.

use super::{HostRegion, Region, RegionError};
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

/// Which memory to carve slots from: `host`, `fake-device` or `cuda[:N]`
/// (the `--device` flag of `kvt` and the demo).
///
/// ```
/// use kv_transfer_core::SlotMemory;
/// assert_eq!("cuda:1".parse::<SlotMemory>().unwrap(), SlotMemory::Cuda { ordinal: 1 });
/// assert_eq!("cuda".parse::<SlotMemory>().unwrap(), SlotMemory::Cuda { ordinal: 0 });
/// assert_eq!(SlotMemory::Host.to_string(), "host");
/// let region = SlotMemory::Host.allocate(1 << 16).unwrap();
/// assert_eq!(region.len(), 1 << 16);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SlotMemory {
    /// Host memory ([`HostRegion`]).
    #[default]
    Host,
    /// Device-like memory that faults on any CPU access (feature `fake-device`).
    FakeDevice,
    /// Memory of the CUDA device with this ordinal (feature `cuda`).
    Cuda {
        /// The device's ordinal.
        ordinal: u32,
    },
}

impl SlotMemory {
    /// Whether slots in this memory are device memory (the CPU must not touch
    /// them through their address).
    pub fn is_device(self) -> bool {
        !matches!(self, Self::Host)
    }

    /// Allocates a region of `len` bytes in this memory. A kind this build
    /// lacks is [`DeviceError::NotBuilt`](crate::DeviceError::NotBuilt), naming the feature.
    pub fn allocate(self, len: usize) -> Result<Arc<dyn Region>, RegionError> {
        match self {
            Self::Host => Ok(Arc::new(HostRegion::new(len)?)),
            #[cfg(all(feature = "fake-device", target_os = "linux"))]
            Self::FakeDevice => Ok(Arc::new(super::FakeDeviceRegion::new(len)?)),
            #[cfg(not(all(feature = "fake-device", target_os = "linux")))]
            Self::FakeDevice => {
                Err(super::DeviceError::NotBuilt { what: "fake-device memory (on Linux)", feature: "fake-device" }
                    .into())
            }
            #[cfg(feature = "cuda")]
            Self::Cuda { ordinal } => Ok(Arc::new(super::CudaRegion::new(ordinal, len)?)),
            #[cfg(not(feature = "cuda"))]
            Self::Cuda { .. } => Err(super::DeviceError::NotBuilt { what: "CUDA memory", feature: "cuda" }.into()),
        }
    }
}

impl fmt::Display for SlotMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Host => f.write_str("host"),
            Self::FakeDevice => f.write_str("fake-device"),
            Self::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

/// A `--device` value that names no memory.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown memory {0:?}: expected host, fake-device, cuda or cuda:N")]
pub struct UnknownMemory(String);

impl FromStr for SlotMemory {
    type Err = UnknownMemory;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "host" => Ok(Self::Host),
            "fake-device" => Ok(Self::FakeDevice),
            "cuda" => Ok(Self::Cuda { ordinal: 0 }),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(|ordinal| Self::Cuda { ordinal })
                .ok_or_else(|| UnknownMemory(s.to_string())),
        }
    }
}
