//! The programming abstraction (paper §5.1): page guards over a [`Pager`].
//!
//! A guard fixes a page in one latch mode and unlatches it when dropped:
//!
//! - [`OptimisticGuard`]: remembers the frame's version; the page may change
//!   or be evicted underneath, so every read is followed by
//!   [`OptimisticGuard::check`] (the paper's `hasChanged`), which turns a
//!   concurrent change into [`PageError::Restart`] (a pager that just
//!   fetched the page keeps it here for the guard's first use, see
//!   [`Fixed::fresh`]);
//! - [`SharedGuard`]: the page is fixed and nobody writes it;
//! - [`ExclusiveGuard`]: the page is fixed and only this guard writes it.
//!
//! Guards upgrade (optimistic → shared / exclusive) and downgrade
//! (exclusive → shared / optimistic). Where a page lives — the local cache,
//! another node's memory, an SSD — and which node-level ownership a mode
//! needs are the pager's business: the same guards run over ScaleStore's
//! distributed pager and over `btree-local`'s plain memory.

use crate::latch::{HybridLatch, Version};
use crate::page::{OutOfPage, PageRef};
use crate::pid::Pid;
use dmkv_api::KvError;
use std::future::Future;

/// How a page is latched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    Optimistic,
    Shared,
    Exclusive,
}

/// Why a guarded operation stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PageError {
    /// Something changed underneath an optimistic read: start over.
    Restart,
    /// A real failure (transport, exhausted resources, corrupt data).
    Fatal(KvError),
}

impl From<KvError> for PageError {
    fn from(e: KvError) -> Self {
        PageError::Fatal(e)
    }
}

impl From<OutOfPage> for PageError {
    fn from(_: OutOfPage) -> Self {
        // Only optimistic reads of changing pages go out of bounds; callers
        // validate and treat it as a restart.
        PageError::Restart
    }
}

pub type PageResult<T> = Result<T, PageError>;

/// A page fixed in the cache: which frame, which page slot, and (for
/// optimistic fixes) the version read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fixed {
    pub pid: Pid,
    pub frame: u32,
    pub slot: u32,
    pub version: Version,
    /// An optimistic fix of a page the pager just fetched: until the guard
    /// is dropped (or any guard of this node lets go of the page), remote
    /// requests do not take the page away, so that this first use can
    /// validate (see `worker`). No latch is held.
    pub fresh: bool,
}

/// What guards need from a buffer manager.
pub trait Pager {
    /// The latch of a frame.
    fn latch(&self, frame: u32) -> &HybridLatch;
    /// The page in a cache slot.
    fn page(&self, slot: u32) -> PageRef<'_>;
    /// Fixes `pid` in `mode`, fetching it and acquiring the node-level
    /// ownership the mode needs. Shared and exclusive fixes return latched.
    fn fix(&self, pid: Pid, mode: Mode) -> impl Future<Output = PageResult<Fixed>>;
    /// A new zeroed page, fixed exclusively.
    fn allocate(&self) -> impl Future<Output = PageResult<Fixed>>;
    /// Upgrades an optimistic fix to exclusive without waiting, if this node may write the page and nothing changed; `false`
    /// means "restart".
    fn try_upgrade_exclusive(&self, f: &Fixed) -> bool;
    /// The catalog page (where the B-tree keeps its root).
    fn catalog(&self) -> Pid;
    /// Counts a restart of an optimistic operation.
    fn note_restart(&self);
    /// A guard let go of (or downgraded) its latch on `frame`: requests
    /// waiting for the frame may proceed.
    fn released(&self, _frame: u32) {}
}

/// An optimistic fix; see the module documentation.
pub struct OptimisticGuard<'a, P: Pager> {
    pager: &'a P,
    f: Fixed,
}

impl<'a, P: Pager> OptimisticGuard<'a, P> {
    pub async fn fix(pager: &'a P, pid: Pid) -> PageResult<Self> {
        let f = pager.fix(pid, Mode::Optimistic).await?;
        Ok(OptimisticGuard { pager, f })
    }

    pub fn pid(&self) -> Pid {
        self.f.pid
    }

    /// The page; whatever is read must be validated with [`Self::check`].
    pub fn page(&self) -> PageRef<'a> {
        self.pager.page(self.f.slot)
    }

    /// Whether the page changed since the fix (the paper's `hasChanged`).
    pub fn has_changed(&self) -> bool {
        !self.pager.latch(self.f.frame).validate(self.f.version)
    }

    /// [`PageError::Restart`] if the page changed since the fix.
    pub fn check(&self) -> PageResult<()> {
        if self.has_changed() {
            Err(PageError::Restart)
        } else {
            Ok(())
        }
    }

    /// Exclusive access if nothing changed; otherwise restart.
    pub fn upgrade_exclusive(self) -> PageResult<ExclusiveGuard<'a, P>> {
        if self.pager.try_upgrade_exclusive(&self.f) {
            Ok(ExclusiveGuard {
                pager: self.pager,
                f: self.f,
            })
        } else {
            Err(PageError::Restart)
        }
    }

    /// Shared access if nothing changed; otherwise restart.
    pub fn upgrade_shared(self) -> PageResult<SharedGuard<'a, P>> {
        if self
            .pager
            .latch(self.f.frame)
            .try_upgrade_optimistic_to_shared(self.f.version)
        {
            Ok(SharedGuard {
                pager: self.pager,
                f: self.f,
            })
        } else {
            Err(PageError::Restart)
        }
    }
}

impl<P: Pager> Drop for OptimisticGuard<'_, P> {
    fn drop(&mut self) {
        if self.f.fresh {
            self.pager.released(self.f.frame);
        }
    }
}

/// A shared fix: the page stays put and unchanged until the guard drops.
pub struct SharedGuard<'a, P: Pager> {
    pager: &'a P,
    f: Fixed,
}

impl<'a, P: Pager> SharedGuard<'a, P> {
    pub async fn fix(pager: &'a P, pid: Pid) -> PageResult<Self> {
        let f = pager.fix(pid, Mode::Shared).await?;
        Ok(SharedGuard { pager, f })
    }

    pub fn pid(&self) -> Pid {
        self.f.pid
    }

    pub fn page(&self) -> PageRef<'a> {
        self.pager.page(self.f.slot)
    }
}

impl<P: Pager> Drop for SharedGuard<'_, P> {
    fn drop(&mut self) {
        self.pager.latch(self.f.frame).unlock_shared();
        self.pager.released(self.f.frame);
    }
}

/// An exclusive fix: only this guard reads or writes the page until it
/// drops, cluster-wide.
pub struct ExclusiveGuard<'a, P: Pager> {
    pager: &'a P,
    f: Fixed,
}

impl<'a, P: Pager> ExclusiveGuard<'a, P> {
    pub async fn fix(pager: &'a P, pid: Pid) -> PageResult<Self> {
        let f = pager.fix(pid, Mode::Exclusive).await?;
        Ok(ExclusiveGuard { pager, f })
    }

    /// A new zeroed page.
    pub async fn allocate(pager: &'a P) -> PageResult<Self> {
        let f = pager.allocate().await?;
        Ok(ExclusiveGuard { pager, f })
    }

    pub fn pid(&self) -> Pid {
        self.f.pid
    }

    pub fn page(&self) -> PageRef<'a> {
        self.pager.page(self.f.slot)
    }

    /// Keeps reading, lets others read too.
    pub fn downgrade_shared(self) -> SharedGuard<'a, P> {
        let this = std::mem::ManuallyDrop::new(self);
        this.pager
            .latch(this.f.frame)
            .downgrade_exclusive_to_shared();
        this.pager.released(this.f.frame);
        SharedGuard {
            pager: this.pager,
            f: this.f,
        }
    }

    /// Lets go of the latch but keeps an optimistic view.
    pub fn downgrade_optimistic(self) -> OptimisticGuard<'a, P> {
        let this = std::mem::ManuallyDrop::new(self);
        let version = this
            .pager
            .latch(this.f.frame)
            .downgrade_exclusive_to_optimistic();
        this.pager.released(this.f.frame);
        OptimisticGuard {
            pager: this.pager,
            f: Fixed {
                version,
                fresh: false,
                ..this.f
            },
        }
    }
}

impl<P: Pager> Drop for ExclusiveGuard<'_, P> {
    fn drop(&mut self) {
        self.pager.latch(self.f.frame).unlock_exclusive();
        self.pager.released(self.f.frame);
    }
}
