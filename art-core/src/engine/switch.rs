//! On/off switches for the engine's optional kernels: on unless their environment variable is
//! `0`, read once, and settable in-process so a benchmark or a check can compare both paths.

use std::sync::atomic::{AtomicU8, Ordering};

pub(crate) struct EnvSwitch {
    var: &'static str,
    /// 0: not read from the environment yet, 1: off, 2: on.
    state: AtomicU8,
}

impl EnvSwitch {
    pub(crate) const fn new(var: &'static str) -> Self {
        EnvSwitch {
            var,
            state: AtomicU8::new(0),
        }
    }

    pub(crate) fn on(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            0 => {
                let on = std::env::var(self.var).map_or(true, |v| v != "0");
                self.set(on);
                on
            }
            state => state == 2,
        }
    }

    pub(crate) fn set(&self, on: bool) {
        self.state.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    }
}
