//! A missing library or a library without the NIXL symbols is a typed error that
//! says what to install, never a panic. (Own test binary: no successful load may
//! happen in this process first, since a successful load is kept.)

use backend_nixl::engine::{LoadError, NixlLibrary, INSTALL_HINT};

#[test]
fn missing_library_and_missing_symbol_are_typed_errors() {
    let dir = std::env::temp_dir().join(format!("kvt-nixl-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");

    // 1. No file at all.
    std::env::set_var("NIXL_LIB_DIR", &dir);
    match NixlLibrary::load() {
        Err(e @ LoadError::NotFound { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(INSTALL_HINT), "{msg}");
        }
        other => panic!("expected NotFound, got {other:?}"),
    }

    // 2. A real shared library that is not NIXL: the first symbol is missing.
    let libc = ["/lib/x86_64-linux-gnu/libc.so.6", "/usr/lib/x86_64-linux-gnu/libc.so.6", "/lib64/libc.so.6"]
        .into_iter()
        .map(std::path::Path::new)
        .find(|p| p.is_file());
    if let Some(libc) = libc {
        let fake = dir.join("libnixl_capi.so");
        let _ = std::fs::remove_file(&fake);
        // A symlink: the loader sees the libc already mapped, not a second copy.
        std::os::unix::fs::symlink(libc, &fake).expect("symlink libc");
        match NixlLibrary::load() {
            Err(e @ LoadError::MissingSymbol { .. }) => {
                let msg = e.to_string();
                assert!(msg.contains("nixl_capi_create_configured_agent"), "{msg}");
                assert!(msg.contains(INSTALL_HINT), "{msg}");
            }
            other => panic!("expected MissingSymbol, got {other:?}"),
        }
    } else {
        eprintln!("no libc.so.6 found; missing-symbol case skipped");
    }

    // 3. A file that is not a shared object at all.
    // (A fresh directory: the loader caches objects by path.)
    let dir3 = dir.join("garbage");
    std::fs::create_dir_all(&dir3).expect("dir");
    std::env::set_var("NIXL_LIB_DIR", &dir3);
    std::fs::write(dir3.join("libnixl_capi.so"), b"not an ELF file").expect("write");
    match NixlLibrary::load() {
        Err(e @ LoadError::Open { .. }) => assert!(e.to_string().contains(INSTALL_HINT)),
        other => panic!("expected Open, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}
