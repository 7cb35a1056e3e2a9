//! [`backend_counters!`]: a backend's own counters (atomics) and their
//! snapshot struct, with the drain's counters (core's
//! [`DrainCounters`](crate::drain::DrainCounters), one set per driver)
//! folded into the same snapshot under the backend's own names.

/// Declares `Counters` (one `AtomicU64` per name, `pub(crate)`) and a
/// snapshot struct with a field per name, plus fields read from the drain
/// driver's counters (`drain:` section: `name = |d| expr` over a
/// [`DrainSnapshot`](crate::drain::DrainSnapshot)). `Counters::snapshot`
/// takes the driver's counters; `fields()` lists every counter with its name.
///
/// ```
/// use kv_transfer_core::drain::{DrainCounters, DrainSnapshot};
/// kv_transfer_core::backend_counters! {
///     /// What my backend counted.
///     #[derive(Clone, Debug, Default)]
///     pub struct MyStats;
///     /// Posts made.
///     posts,
///     ; drain:
///     /// Control messages dropped.
///     dropped = |d| d.stale + d.forged,
/// }
/// let own = Counters::default();
/// own.posts.fetch_add(2, std::sync::atomic::Ordering::Relaxed);
/// let drain = DrainCounters::default();
/// DrainCounters::add(&drain.forged, 1);
/// let s: MyStats = own.snapshot(&drain);
/// assert_eq!((s.posts, s.dropped), (2, 1));
/// assert_eq!(s.fields(), vec![("posts", 2), ("dropped", 1)]);
/// ```
#[macro_export]
macro_rules! backend_counters {
    (
        $(#[$smeta:meta])* $vis:vis struct $snap:ident;
        $($(#[$doc:meta])* $name:ident),* $(,)?
        ; drain: $($(#[$ddoc:meta])* $dname:ident = |$d:ident| $dexpr:expr),* $(,)?
    ) => {
        /// The backend's own counters (the drain's are core's driver's).
        #[derive(Debug, Default)]
        pub(crate) struct Counters {
            $(pub(crate) $name: ::std::sync::atomic::AtomicU64,)*
        }

        $(#[$smeta])*
        $vis struct $snap {
            $($(#[$doc])* pub $name: u64,)*
            $($(#[$ddoc])* pub $dname: u64,)*
        }

        impl Counters {
            /// The backend's counters and the drain's, now.
            #[allow(dead_code)]
            pub(crate) fn snapshot(&self, drain: &$crate::drain::DrainCounters) -> $snap {
                let drain = drain.snapshot();
                $snap {
                    $($name: self.$name.load(::std::sync::atomic::Ordering::Relaxed),)*
                    $($dname: { let $d = &drain; $dexpr },)*
                }
            }
        }

        impl $snap {
            /// Every counter with its name.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)* $((stringify!($dname), self.$dname),)*]
            }
        }
    };
}
