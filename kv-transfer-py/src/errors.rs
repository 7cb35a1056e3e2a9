//! The package's exceptions: one base, one class per kind of refusal, so a
//! serving engine can tell "try later" (admission) from "a bug or a hostile
//! peer" (state, descriptor) without parsing messages.

use kv_transfer_core::{AccessError, AdmissionError, BackendError, ExposeErrorKind, PostErrorKind};
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(kv_transfer, KvTransferError, PyException, "Base class of every kv_transfer error.");
create_exception!(
    kv_transfer,
    LeaseStateError,
    KvTransferError,
    "The lease is not in a state that allows this (e.g. releasing or reading an exposed lease). Nothing changed."
);
create_exception!(
    kv_transfer,
    AdmissionRefused,
    KvTransferError,
    "The pool refused a reservation (over capacity, or a page that is still leased or quarantined). Nothing was reserved."
);
create_exception!(
    kv_transfer,
    DescriptorError,
    KvTransferError,
    "A peer's descriptor or exposure is malformed or does not match the local pages. Nothing was posted."
);
create_exception!(
    kv_transfer,
    BackendUnavailable,
    KvTransferError,
    "The backend is not compiled in, or its engine or device is missing (the message says what to install)."
);
create_exception!(kv_transfer, BackendFailure, KvTransferError, "The backend or its engine refused an operation.");
create_exception!(
    kv_transfer,
    IntegrityError,
    KvTransferError,
    "A settled page's bytes do not match the digest its DONE carried: a write landed after it. No byte was handed over."
);

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvTransferError", py.get_type::<KvTransferError>())?;
    m.add("LeaseStateError", py.get_type::<LeaseStateError>())?;
    m.add("AdmissionRefused", py.get_type::<AdmissionRefused>())?;
    m.add("DescriptorError", py.get_type::<DescriptorError>())?;
    m.add("BackendUnavailable", py.get_type::<BackendUnavailable>())?;
    m.add("BackendFailure", py.get_type::<BackendFailure>())?;
    m.add("IntegrityError", py.get_type::<IntegrityError>())?;
    Ok(())
}

pub(crate) fn admission(e: AdmissionError) -> PyErr {
    AdmissionRefused::new_err(e.to_string())
}

pub(crate) fn backend(e: BackendError) -> PyErr {
    match e {
        BackendError::Peer(_) => DescriptorError::new_err(e.to_string()),
        _ => BackendFailure::new_err(e.to_string()),
    }
}

pub(crate) fn expose(kind: &ExposeErrorKind) -> PyErr {
    match kind {
        ExposeErrorKind::UnknownPeer(_) => DescriptorError::new_err(kind.to_string()),
        _ => BackendFailure::new_err(kind.to_string()),
    }
}

pub(crate) fn post(kind: &PostErrorKind) -> PyErr {
    match kind {
        PostErrorKind::ForeignPool | PostErrorKind::Descriptor(_) | PostErrorKind::Peer(_) => {
            DescriptorError::new_err(kind.to_string())
        }
        _ => BackendFailure::new_err(kind.to_string()),
    }
}

pub(crate) fn access(e: AccessError) -> PyErr {
    match e {
        AccessError::Integrity { .. } => IntegrityError::new_err(e.to_string()),
        _ => LeaseStateError::new_err(e.to_string()),
    }
}
