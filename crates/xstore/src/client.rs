//! The per-thread client: GET and SCAN one-sided through the learned cache
//! (§5.2), writes by RPC (§5.3), fallbacks, speculative execution.
//!
//! A lookup (Fig. 7) predicts the logical leaves `[s, e]` of a key, reads
//! them in one doorbell batch (more if the range is wider than
//! `xstore.batch_limit`), checks each leaf's incarnation against its TT
//! entry, and searches the keys. Then:
//! - found in a consistent leaf image: the key is there (whatever the
//!   incarnation); its value is read next from its slot line (key lines
//!   read, `xstore.get_read=keys`: two round trips in all, the paper's two
//!   READs), or came with the whole leaf (`get_read=leaves`: one round
//!   trip), and an out-of-line one is read from its block;
//! - a leaf's incarnation differs (it split since training): the entry is
//!   invalidated and, unless the key is in the split leaf, its right
//!   sibling is read once (speculative execution, §5.3.2); if the key is
//!   not there either, the GET falls back to the server;
//! - not found, every incarnation as expected: the key is absent if the
//!   leaves read provably cover it (docs/xstore.md, invariant 6), else the
//!   read range is extended by one leaf on the uncovered side, a bounded
//!   number of times, before falling back.
//!
//! A prediction spanning more than `xstore.max_leaves` leaves is not read:
//! the lookup takes the fallback RPC at once (cause `wide_prediction`), so
//! one lookup never costs more than a bounded number of leaves.

use crate::cache::{GenCache, PartClient, SubCache};
use crate::config::{CacheMode, XStoreConfig};
use crate::layout::{SubRecord, TtEntry};
use crate::scan_chain::{Absorbed, Chain, LeafFacts, Pending, ScanStop};
use crate::stats::{ClientStats, FallbackCause};
use crate::wire::*;
use dmkv_api::{Key, KvClient, KvError, Result};
use dmkv_transport::{Endpoint, WireReader, WireWriter};
use dmkv_xtree::view::{LeafFind, parse_block, parse_slot_line};
use dmkv_xtree::{FatPtr, KeysView, MAX_HINT_LEAVES, Meta, NodeView, SlotValue, ViewError};
use std::rc::Rc;
use std::sync::Arc;

/// Consecutive torn or locked leaf reads before a lookup falls back.
const TORN_RETRIES: usize = 64;
/// Leaves a lookup may add to a prediction to prove a key absent.
const MAX_EXTENSIONS: usize = 4;
/// Widest prediction whose first read a lookup checks and searches in
/// place ([`Client::first_read_in_place`]); a wider one (rare: 0.5% of
/// lookups span 4 or more leaves at 1 M uniform keys) takes the general
/// loop from the start.
const IN_PLACE_LEAVES: usize = 4;

/// What every client thread of one engine shares.
pub struct Shared {
    pub cfg: XStoreConfig,
    pub parts: Vec<PartClient>,
    /// Read whole leaves (values or fat pointers included) instead of the
    /// key lines (then the value is one more read of its slot line): set by
    /// `xstore.get_read=leaves`; the default `keys` reads the key lines, as
    /// the paper does (docs/xstore.md, GET).
    pub whole_leaves: bool,
    pub stats: Arc<ClientStats>,
}

impl Shared {
    pub fn part_of(&self, key: Key) -> &PartClient {
        &self.parts[self.cfg.parts.of(key)]
    }
}

/// A leaf image, as read for a lookup.
enum Image {
    Keys(KeysView),
    Whole(NodeView),
}

impl Image {
    fn keys(&self) -> &KeysView {
        match self {
            Image::Keys(k) => k,
            Image::Whole(n) => &n.keys,
        }
    }
}

/// A leaf read: its partition and node number, the TT entry it was read
/// for, its image.
struct Leaf {
    part: usize,
    node: u32,
    entry: Option<TtEntry>,
    image: Image,
}

/// Where a lookup found its key.
struct Found {
    leaf: u32,
    slot: usize,
    at: ValueAt,
}

/// Where the value of a found key is to be had.
enum ValueAt {
    /// In the leaf's slot line, which must carry `version`, the version of
    /// the key lines that found the key (`meta` tells inline from out of
    /// line).
    SlotLine { version: u64, meta: Meta },
    /// In this whole-leaf image.
    Image(NodeView),
}

impl Found {
    fn in_image(leaf: u32, slot: usize, image: Image) -> Found {
        let at = match image {
            Image::Keys(k) => ValueAt::SlotLine {
                version: k.version,
                meta: k.meta,
            },
            Image::Whole(n) => ValueAt::Image(n),
        };
        Found { leaf, slot, at }
    }
}

/// How the first read of a lookup ended ([`Client::first_read_in_place`]).
enum FirstRead {
    /// The lookup's answer.
    Done(Lookup),
    /// Every leaf read is a consistent leaf image and none holds the key:
    /// the general loop takes over with these images (whether one split or
    /// the read proves the key absent is decided there).
    Continue(Vec<(u32, Leaf)>),
}

/// Where a scan's plan of the next leaves stands: partition, model
/// generation, sub-model, its TT, the next logical leaf, and the last leaf
/// planned or read in this partition (a leaf straddling two sub-models
/// heads the second's TT too and is not read twice).
struct PlanCursor {
    part: usize,
    g: Arc<GenCache>,
    i: u32,
    v: SubView,
    lln: u32,
    last: Option<u32>,
}

enum Lookup {
    Found(Found),
    Absent,
    Fallback(FallbackCause),
}

/// The TT access a lookup has: cached entries (full) or entries read for
/// it (models-only, top-only).
struct SubView {
    record: SubRecord,
    cached: Option<Arc<SubCache>>,
}

/// A compute thread's handle.
pub struct Client {
    ep: Rc<Endpoint>,
    sh: Arc<Shared>,
}

impl Client {
    pub fn new(ep: Rc<Endpoint>, sh: Arc<Shared>) -> Client {
        Client { ep, sh }
    }

    fn stats(&self) -> &ClientStats {
        &self.sh.stats
    }

    // ---- leaves --------------------------------------------------------------

    /// Reads `leaves` of partition `p` in doorbell batches of at most
    /// `batch_limit` and parses them. `Err(None)` if one was torn or locked
    /// (retry the lookup).
    async fn read_leaves(
        &self,
        p: &PartClient,
        leaves: &[(u32, Option<TtEntry>)],
        whole: bool,
    ) -> Result<std::result::Result<Vec<Leaf>, Option<ViewError>>> {
        let targets: Vec<(usize, u32, Option<TtEntry>)> =
            leaves.iter().map(|&(n, e)| (p.index, n, e)).collect();
        self.read_leaves_in(&targets, whole).await
    }

    /// Reads `(partition, leaf, entry)` targets, of one or several memory
    /// nodes, in doorbell batches of at most `batch_limit` (one round trip
    /// per batch whatever nodes it reaches) and parses them.
    async fn read_leaves_in(
        &self,
        leaves: &[(usize, u32, Option<TtEntry>)],
        whole: bool,
    ) -> Result<std::result::Result<Vec<Leaf>, Option<ViewError>>> {
        let limit = self.sh.cfg.batch_limit;
        if leaves.len() > limit {
            ClientStats::bump(&self.stats().multi_batch_reads);
        }
        let span_of = |p: &PartClient| {
            if whole {
                p.geo.node_span()
            } else {
                p.geo.key_span()
            }
        };
        let mut out = Vec::with_capacity(leaves.len());
        let mut failed = None;
        for chunk in leaves.chunks(limit) {
            let mut b = self.ep.batch();
            for (part, node, _) in chunk {
                let p = &self.sh.parts[*part];
                let nb = p.geo.node_bytes() as u64;
                b.read(p.nodes.at(*node as u64 * nb), span_of(p).len(&p.geo));
            }
            let res = b.run().await?;
            ClientStats::bump(&self.stats().leaf_batches);
            self.stats()
                .leaves_read
                .fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
            for (i, (part, node, entry)) in chunk.iter().enumerate() {
                let geo = &self.sh.parts[*part].geo;
                let bytes = res.read(i);
                let parsed = if whole {
                    NodeView::parse(geo, bytes).map(Image::Whole)
                } else {
                    KeysView::parse(geo, span_of(&self.sh.parts[*part]), bytes).map(Image::Keys)
                };
                match parsed {
                    Ok(image) if image.keys().is_leaf() => out.push(Leaf {
                        part: *part,
                        node: *node,
                        entry: *entry,
                        image,
                    }),
                    Ok(_) => failed = Some(Some(ViewError::Malformed("not a leaf".into()))),
                    Err(e) if e.is_transient() => {
                        if failed.is_none() {
                            failed = Some(None);
                        }
                    }
                    Err(e) => failed = Some(Some(e)),
                }
            }
        }
        Ok(match failed {
            None => Ok(out),
            Some(e) => Err(e),
        })
    }

    /// The sub-model for `key` in `g` and access to its TT, per cache mode.
    /// `None`: the model could not be had consistently.
    async fn sub_view(&self, p: &PartClient, g: &GenCache, i: u32) -> Result<Option<SubView>> {
        match p.mode {
            CacheMode::Full | CacheMode::ModelsOnly => {
                Ok(p.sub(&self.ep, g, i).await?.map(|s| SubView {
                    record: s.record,
                    cached: (p.mode == CacheMode::Full).then_some(s),
                }))
            }
            CacheMode::TopOnly => Ok(p.read_record(&self.ep, g, i).await?.map(|record| SubView {
                record,
                cached: None,
            })),
        }
    }

    /// TT entries `first..=last` of `v`: cached, or read one-sided.
    /// `None`: the TT block changed (the record is stale).
    async fn entries(
        &self,
        p: &PartClient,
        v: &SubView,
        first: u32,
        last: u32,
    ) -> Result<Option<Vec<u64>>> {
        match &v.cached {
            Some(s) => Ok(Some((first..=last).map(|n| s.entry(n)).collect())),
            None => p.read_tt(&self.ep, &v.record, first, last).await,
        }
    }

    /// The first read of a lookup whose `s..=e` (at most
    /// [`IN_PLACE_LEAVES`], one batch) has cached TT entries and reads key
    /// lines: the same entries, reads, statistics, retries and answers as
    /// the general loop of [`Client::lookup`] (which it replaces for that
    /// read), but each image is checked and searched where it lies
    /// (`KeysView::find_in_image`, the same checks as `KeysView::parse` in
    /// the same order) instead of being parsed into vectors, and without
    /// the loop's vectors of wanted leaves, runs, entries and targets. Only
    /// when no image holds the key are the images parsed and handed back.
    async fn first_read_in_place(
        &self,
        p: &PartClient,
        c: &SubCache,
        key: Key,
        s: u32,
        e: u32,
        torn: &mut usize,
    ) -> Result<FirstRead> {
        let n = (e - s + 1) as usize;
        debug_assert!(n <= IN_PLACE_LEAVES && n <= self.sh.cfg.batch_limit);
        let geo = &p.geo;
        let span = geo.key_span();
        let len = span.len(geo);
        let nb = geo.node_bytes() as u64;
        loop {
            // Entries `s..=e` (the rest of the array is unused).
            let mut entries = [TtEntry::unpack(0); IN_PLACE_LEAVES];
            for (slot, lln) in entries.iter_mut().zip(s..=e) {
                *slot = TtEntry::unpack(c.entry(lln));
                if !slot.valid {
                    return Ok(FirstRead::Done(Lookup::Fallback(
                        FallbackCause::InvalidEntry,
                    )));
                }
            }
            // The batch is built in a block that ends before the await:
            // only its run future lives across it (a `Batch` kept in scope
            // would hold a second ~240 bytes of verbs in this future's state).
            let run = {
                let mut b = self.ep.batch();
                for t in &entries[..n] {
                    b.read(p.nodes.at(t.leaf as u64 * nb), len);
                }
                b.run()
            };
            let res = run.await?;
            ClientStats::bump(&self.stats().leaf_batches);
            self.stats()
                .leaves_read
                .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            // Checked as read_leaves_in checks: any image that is not a
            // consistent leaf makes the lookup fall back, unless every such
            // image is only torn or locked (then the read is retried). The
            // first image (in logical order) holding the key answers, once
            // every image has passed.
            let mut first: Option<(usize, LeafFind)> = None;
            let mut failed: Option<bool> = None; // Some(true): only transient
            for j in 0..n {
                match KeysView::find_in_image(geo, span, res.read(j), key) {
                    Ok(f) if f.meta.level == 0 => {
                        if first.is_none() && f.slot.is_some() {
                            first = Some((j, f));
                        }
                    }
                    Ok(_) => failed = Some(false),
                    Err(err) if err.is_transient() => {
                        failed.get_or_insert(true);
                    }
                    Err(_) => failed = Some(false),
                }
            }
            match failed {
                Some(false) => {
                    return Ok(FirstRead::Done(Lookup::Fallback(
                        FallbackCause::Incarnation,
                    )));
                }
                Some(true) => {
                    ClientStats::bump(&self.stats().torn_retries);
                    *torn += 1;
                    if *torn >= TORN_RETRIES {
                        return Ok(FirstRead::Done(Lookup::Fallback(FallbackCause::Torn)));
                    }
                    continue;
                }
                None => {}
            }
            if let Some((j, f)) = first {
                let t = &entries[j];
                if f.header.incarnation != t.incarnation {
                    ClientStats::bump(&self.stats().found_in_split_leaf);
                }
                return Ok(FirstRead::Done(Lookup::Found(Found {
                    leaf: t.leaf,
                    slot: f.slot.expect("found"),
                    at: ValueAt::SlotLine {
                        version: f.version,
                        meta: f.meta,
                    },
                })));
            }
            // In none: parsed for the general loop. `find_in_image` made
            // `parse`'s checks, so parsing cannot fail; if it did, the
            // image is treated as the loop treats a malformed one.
            let mut read = Vec::with_capacity(n);
            for (j, (lln, t)) in (s..=e).zip(&entries[..n]).enumerate() {
                let Ok(image) = KeysView::parse(geo, span, res.read(j)) else {
                    return Ok(FirstRead::Done(Lookup::Fallback(
                        FallbackCause::Incarnation,
                    )));
                };
                read.push((
                    lln,
                    Leaf {
                        part: p.index,
                        node: t.leaf,
                        entry: Some(*t),
                        image: Image::Keys(image),
                    },
                ));
            }
            return Ok(FirstRead::Continue(read));
        }
    }

    /// LOOKUP (Fig. 7) of `key` in partition `p`.
    async fn lookup(&self, p: &PartClient, key: Key, whole: bool) -> Result<Lookup> {
        ClientStats::bump(&self.stats().lookups);
        let mut torn = 0;
        // The first prediction of this lookup is counted by its span.
        let mut counted = false;
        'model: for _ in 0..crate::cache::MODEL_RETRIES {
            // The cached generation and sub-model without an await (the
            // common case); fetched one-sided otherwise.
            let g = match p.cached_gen() {
                Some(g) => g,
                None => Box::pin(p.fetch_header(&self.ep)).await?,
            };
            let i = g.header.route(key);
            let cached = match p.mode {
                CacheMode::Full | CacheMode::ModelsOnly => g.sub(i).map(|s| SubView {
                    record: s.record,
                    cached: (p.mode == CacheMode::Full).then_some(s),
                }),
                CacheMode::TopOnly => None,
            };
            let v = match cached {
                Some(v) => Some(v),
                None => Box::pin(self.sub_view(p, &g, i)).await?,
            };
            let Some(v) = v else {
                // The generation moved on: learn the new header.
                Box::pin(p.fetch_header(&self.ep)).await?;
                continue 'model;
            };
            let t = v.record.tt_len;
            let Some((s, e)) = v.record.leaf_range(key, g.header.slots) else {
                return Ok(Lookup::Fallback(FallbackCause::Model));
            };
            if !counted {
                counted = true;
                let span = ((e - s) as usize).min(4);
                ClientStats::bump(&self.stats().predicted_span[span]);
            }
            if (e - s) as usize >= self.sh.cfg.max_leaves {
                // Bounded cost (xstore.max_leaves): one RPC rather than
                // many leaves and round trips.
                return Ok(Lookup::Fallback(FallbackCause::WidePrediction));
            }
            // Leaves read so far, by logical number, and leaves still to be
            // read (made after the first read's await: nothing but what that
            // read needs lives across it).
            let n = (e - s + 1) as usize;
            let (read, want): (Vec<(u32, Leaf)>, Vec<u32>) = match &v.cached {
                Some(c) if !whole && n <= IN_PLACE_LEAVES && n <= self.sh.cfg.batch_limit => {
                    match self.first_read_in_place(p, c, key, s, e, &mut torn).await? {
                        FirstRead::Done(l) => return Ok(l),
                        FirstRead::Continue(images) => (images, Vec::new()),
                    }
                }
                _ => (Vec::new(), (s..=e).collect()),
            };
            // The rest (the images did not hold the key, or the first read
            // was not in place) is rare: boxed, so that its state adds
            // nothing to every GET's future.
            match Box::pin(self.general_loop(
                p,
                key,
                whole,
                &g,
                i,
                &v,
                (s, e, t),
                read,
                want,
                &mut torn,
            ))
            .await?
            {
                Some(l) => return Ok(l),
                None => continue 'model,
            }
        }
        Ok(Lookup::Fallback(FallbackCause::Model))
    }

    /// The general loop of [`Client::lookup`] for its prediction `s..=e` of
    /// a TT of `t` entries, from the images `read` so far and the leaves
    /// `want`ed: reads, searches, speculates and extends the range (Fig. 7).
    /// `None`: the sub-model's TT changed (retry with a fresh model).
    #[allow(clippy::too_many_arguments)]
    async fn general_loop(
        &self,
        p: &PartClient,
        key: Key,
        whole: bool,
        g: &GenCache,
        i: u32,
        v: &SubView,
        (mut s, mut e, t): (u32, u32, u32),
        mut read: Vec<(u32, Leaf)>,
        mut want: Vec<u32>,
        torn: &mut usize,
    ) -> Result<Option<Lookup>> {
        let mut extensions = 0;
        loop {
            if !want.is_empty() {
                // Entries for each contiguous run of wanted leaves, then
                // every leaf in one batch.
                let mut targets: Vec<(u32, Option<TtEntry>)> = Vec::new();
                for (lo, hi) in runs(&want) {
                    let Some(raw) = Box::pin(self.entries(p, v, lo, hi)).await? else {
                        if p.mode == CacheMode::Full {
                            return Ok(Some(Lookup::Fallback(FallbackCause::Model)));
                        }
                        // Retrained since the record was read: re-read it.
                        p.evict_sub(g, i);
                        return Ok(None);
                    };
                    targets.extend(raw.iter().map(|&w| {
                        let e = TtEntry::unpack(w);
                        (e.leaf, Some(e))
                    }));
                }
                if targets.iter().any(|(_, e)| !e.is_some_and(|e| e.valid)) {
                    return Ok(Some(Lookup::Fallback(FallbackCause::InvalidEntry)));
                }
                match Box::pin(self.read_leaves(p, &targets, whole)).await? {
                    Ok(leaves) => {
                        for (n, l) in want.iter().zip(leaves) {
                            read.push((*n, l));
                        }
                    }
                    Err(None) => {
                        ClientStats::bump(&self.stats().torn_retries);
                        *torn += 1;
                        if *torn >= TORN_RETRIES {
                            return Ok(Some(Lookup::Fallback(FallbackCause::Torn)));
                        }
                        read.clear();
                        want = (s..=e).collect();
                        continue;
                    }
                    Err(Some(_)) => return Ok(Some(Lookup::Fallback(FallbackCause::Incarnation))),
                }
                read.sort_by_key(|x| x.0);
                want.clear();
            }
            // Search every image; a key found in a consistent image is
            // there, split or not.
            let mut stale = Vec::new();
            for (n, l) in read.iter() {
                let entry = l.entry.expect("read through the TT");
                if l.image.keys().incarnation() != entry.incarnation {
                    stale.push(*n);
                }
            }
            if let Some(pos) = read
                .iter()
                .position(|(_, l)| l.image.keys().find(key).is_some())
            {
                let (n, l) = read.swap_remove(pos);
                if stale.contains(&n) {
                    ClientStats::bump(&self.stats().found_in_split_leaf);
                }
                let slot = l.image.keys().find(key).expect("just found");
                return Ok(Some(Lookup::Found(Found::in_image(l.node, slot, l.image))));
            }
            if !stale.is_empty() {
                // Invalidate (Fig. 7, line 18) and speculate.
                if let Some(c) = &v.cached {
                    for (n, l) in read.iter().filter(|(n, _)| stale.contains(n)) {
                        c.invalidate(*n, l.entry.expect("read through the TT").pack());
                    }
                }
                if !self.sh.cfg.speculation {
                    return Ok(Some(Lookup::Fallback(FallbackCause::Incarnation)));
                }
                ClientStats::bump(&self.stats().speculations);
                let siblings: Vec<(u32, Option<TtEntry>)> = read
                    .iter()
                    .filter(|(n, _)| stale.contains(n))
                    .map(|(_, l)| l.image.keys().header.next)
                    .filter(|&next| next != 0)
                    .map(|next| (next, None))
                    .collect();
                if siblings.is_empty() {
                    return Ok(Some(Lookup::Fallback(FallbackCause::Incarnation)));
                }
                let sibs = match Box::pin(self.read_leaves(p, &siblings, whole)).await? {
                    Ok(s) => s,
                    Err(_) => return Ok(Some(Lookup::Fallback(FallbackCause::Incarnation))),
                };
                for l in sibs {
                    if let Some(slot) = l.image.keys().find(key) {
                        ClientStats::bump(&self.stats().speculative_hits);
                        return Ok(Some(Lookup::Found(Found::in_image(l.node, slot, l.image))));
                    }
                }
                return Ok(Some(Lookup::Fallback(FallbackCause::Incarnation)));
            }
            // Absent from every leaf read; all are as trained, so their
            // ranges are those of training and contiguous. Absent for
            // sure if they cover the key (invariant 6).
            let (left_ok, right_ok) = coverage(&read, key, s, e, t);
            if left_ok && right_ok {
                return Ok(Some(Lookup::Absent));
            }
            extensions += 1;
            if extensions > MAX_EXTENSIONS {
                return Ok(Some(Lookup::Fallback(FallbackCause::Coverage)));
            }
            ClientStats::bump(&self.stats().coverage_extensions);
            if !left_ok {
                s -= 1;
                want.push(s);
            }
            if !right_ok {
                e += 1;
                want.push(e);
            }
            want.sort_unstable();
        }
    }

    /// The value of a found key: from the image (whole leaves, inline), or
    /// its slot line, or its block. `None`: the leaf or block changed since
    /// the image was read (retry the lookup).
    async fn read_value(&self, p: &PartClient, key: Key, f: &Found) -> Result<Option<Vec<u8>>> {
        let geo = &p.geo;
        let base = f.leaf as u64 * geo.node_bytes() as u64;
        let fat = match &f.at {
            ValueAt::Image(n) => match n.value(f.slot) {
                SlotValue::Inline(b) => return Ok(Some(b.to_vec())),
                SlotValue::OutOfLine(fat) => fat,
            },
            ValueAt::SlotLine { version, meta } => {
                let span = geo.slot_span(f.slot);
                let bytes = self
                    .ep
                    .read_buf(p.nodes.at(base + span.offset() as u64), span.len(geo))
                    .await?;
                let Ok(word) = parse_slot_line(geo, f.slot, *version, &bytes) else {
                    return Ok(None);
                };
                match SlotValue::decode(meta, f.slot, word) {
                    SlotValue::Inline(b) => return Ok(Some(b.to_vec())),
                    SlotValue::OutOfLine(fat) => fat,
                }
            }
        };
        self.read_block(p, key, fat).await
    }

    async fn read_block(&self, p: &PartClient, key: Key, fat: FatPtr) -> Result<Option<Vec<u8>>> {
        let bytes = self
            .ep
            .read_buf(p.values.at(fat.offset), fat.block_len())
            .await?;
        Ok(parse_block(key, fat, &bytes).ok())
    }

    fn want(&self, p: &PartClient) -> u8 {
        match p.mode {
            CacheMode::Full => WANT_RECORD_AND_TT,
            CacheMode::ModelsOnly => WANT_RECORD,
            CacheMode::TopOnly => WANT_NOTHING,
        }
    }

    fn generation(&self, p: &PartClient) -> u32 {
        p.cached_gen().map_or(0, |g| g.header.generation)
    }

    async fn call(&self, p: &PartClient, req: Vec<u8>) -> Result<Vec<u8>> {
        Ok(self.ep.call(p.node, p.service, req).await?)
    }

    /// GET by the server, refreshing the model (the fallback path).
    async fn fallback_get(
        &self,
        p: &PartClient,
        key: Key,
        cause: FallbackCause,
    ) -> Result<Option<Vec<u8>>> {
        self.stats().fallback(cause);
        let mut w = WireWriter::new();
        w.u8(OP_GET)
            .u64(key)
            .u32(self.generation(p))
            .u8(self.want(p));
        let reply = self.call(p, w.finish()).await?;
        let mut r = WireReader::new(&reply);
        let v = if wire(r.bool())? {
            Some(wire(r.bytes())?.to_vec())
        } else {
            None
        };
        let update = wire(ModelUpdate::decode(&mut r))?;
        wire(r.end())?;
        p.install_update(update);
        Ok(v)
    }

    // ---- SCAN ----------------------------------------------------------------

    /// The one-sided part of a SCAN from `start` in partition `first`
    /// (§5.2.2, §5.5): a lookup of the start reading whole leaves, then the
    /// following leaves predicted from the TT counts, read in one batch
    /// per round, along the chain of right links. When the TTs of a
    /// partition run out before `n` pairs, the plan goes on with the next
    /// partition's first leaves (its first sub-model's TT, which starts at
    /// the partition's first key), in the same batch: one round trip for
    /// every memory node involved. Appends to `out` (out-of-line values to
    /// `pending`) and says where the scan stopped.
    async fn scan_walk(
        &self,
        first: usize,
        start: Key,
        n: usize,
        out: &mut Vec<(Key, Vec<u8>)>,
        pending: &mut Vec<Pending>,
    ) -> Result<ScanStop> {
        let p = &self.sh.parts[first];
        let fallback = |cause| ScanStop::Fallback(first, start, cause);
        // Round 1: the predicted leaves of the start, whole, each as
        // trained, extended left until they provably hold the start.
        let mut tries = 0;
        let (g, i, v, s, mut batch) = loop {
            tries += 1;
            if tries > crate::cache::MODEL_RETRIES {
                return Ok(fallback(FallbackCause::Model));
            }
            let g = p.generation(&self.ep).await?;
            let i = g.header.route(start);
            let Some(v) = self.sub_view(p, &g, i).await? else {
                p.fetch_header(&self.ep).await?;
                continue;
            };
            let Some((mut s, e)) = v.record.leaf_range(start, g.header.slots) else {
                return Ok(fallback(FallbackCause::Model));
            };
            let mut ext = 0;
            let mut torn = 0;
            let leaves = loop {
                let Some(raw) = self.entries(p, &v, s, e).await? else {
                    return Ok(fallback(FallbackCause::Model));
                };
                let entries: Vec<TtEntry> = raw.iter().map(|&w| TtEntry::unpack(w)).collect();
                if entries.iter().any(|x| !x.valid) {
                    return Ok(fallback(FallbackCause::InvalidEntry));
                }
                let targets: Vec<(u32, Option<TtEntry>)> =
                    entries.iter().map(|x| (x.leaf, Some(*x))).collect();
                let leaves = match self.read_leaves(p, &targets, true).await? {
                    Ok(l) => l,
                    Err(None) => {
                        ClientStats::bump(&self.stats().torn_retries);
                        torn += 1;
                        if torn >= TORN_RETRIES {
                            return Ok(fallback(FallbackCause::Torn));
                        }
                        continue;
                    }
                    Err(Some(_)) => return Ok(fallback(FallbackCause::ScanChain)),
                };
                if leaves.iter().any(|l| {
                    l.image.keys().incarnation() != l.entry.expect("read via the TT").incarnation
                }) {
                    if let Some(c) = &v.cached {
                        for (j, l) in leaves.iter().enumerate() {
                            let en = l.entry.expect("read via the TT");
                            if l.image.keys().incarnation() != en.incarnation {
                                c.invalidate(s + j as u32, en.pack());
                            }
                        }
                    }
                    return Ok(fallback(FallbackCause::ScanChain));
                }
                let left_ok = s == 0
                    || leaves
                        .iter()
                        .any(|l| l.image.keys().keys.iter().any(|&k| k <= start));
                if left_ok {
                    break leaves;
                }
                ext += 1;
                if ext > MAX_EXTENSIONS {
                    return Ok(fallback(FallbackCause::Coverage));
                }
                ClientStats::bump(&self.stats().coverage_extensions);
                s -= 1;
            };
            break (g, i, v, s, leaves);
        };
        let last = batch.last().map(|l| l.node);
        let mut plan = PlanCursor {
            part: first,
            g,
            i,
            lln: s + batch.len() as u32,
            v,
            last,
        };
        let mut chain = Chain {
            at: first,
            next: Some(start),
            prev_next: None,
            parts: self.sh.parts.iter().map(|x| x.lo).collect(),
        };
        let stats = self.stats();
        loop {
            ClientStats::bump(&stats.scan_rounds);
            for l in &batch {
                let Image::Whole(img) = &l.image else {
                    unreachable!("scans read whole leaves")
                };
                let facts = LeafFacts {
                    part: l.part,
                    node: l.node,
                    as_trained: l.entry.expect("read via the TT").incarnation
                        == l.image.keys().incarnation(),
                    next: l.image.keys().header.next,
                };
                match chain.absorb(&facts, &img.sorted_pairs(), start, n, out, pending) {
                    Absorbed::Taken => ClientStats::bump(&stats.scan_leaves),
                    Absorbed::Crossed => {
                        ClientStats::bump(&stats.scan_partition_crossings);
                        ClientStats::bump(&stats.scan_leaves);
                    }
                    Absorbed::Stop(stop) => return Ok(stop),
                }
            }
            let at = chain.at;
            if out.len() >= n {
                return Ok(chain.resume());
            }
            // The chain reached this partition's rightmost leaf: every key
            // of it from the start is in `out`.
            let ended = chain.prev_next == Some(0);
            if ended && plan.part == at && !self.plan_next_partition(&mut plan).await? {
                return Ok(chain.part_start(at + 1));
            }
            let targets = self.plan_leaves(&mut plan, n - out.len()).await?;
            if targets.is_empty() || targets.iter().any(|t| !t.2.is_some_and(|e| e.valid)) {
                return Ok(if ended {
                    // Nothing to predict the next partition with.
                    chain.part_start(at + 1)
                } else {
                    chain.fall_back()
                });
            }
            batch = match self.read_leaves_in(&targets, true).await? {
                Ok(l) => l,
                Err(_) if ended => return Ok(chain.part_start(at + 1)),
                Err(_) => return Ok(chain.fall_back()),
            };
        }
    }

    /// Moves `plan` to the first leaf of the partition after its own (the
    /// head of its first sub-model with a TT). False if there is none or
    /// its model cannot be had.
    async fn plan_next_partition(&self, plan: &mut PlanCursor) -> Result<bool> {
        let q = plan.part + 1;
        let Some(pc) = self.sh.parts.get(q) else {
            return Ok(false);
        };
        let g = pc.generation(&self.ep).await?;
        for j in 0..g.header.submodels {
            match self.sub_view(pc, &g, j).await? {
                // Its first leaf covers the partition's first key
                // (invariant 1) only if its interval starts there.
                Some(v) if v.record.tt_len > 0 && v.record.base != pc.lo => return Ok(false),
                Some(v) if v.record.tt_len > 0 => {
                    *plan = PlanCursor {
                        part: q,
                        g,
                        i: j,
                        v,
                        lln: 0,
                        last: None,
                    };
                    return Ok(true);
                }
                Some(_) => {}
                None => return Ok(false),
            }
        }
        Ok(false)
    }

    /// The next leaves after `plan`, enough by their TT counts for
    /// `missing` pairs (at most one batch), along this TT, on into the next
    /// sub-models' TTs, and on into the next partitions'.
    async fn plan_leaves(
        &self,
        plan: &mut PlanCursor,
        missing: usize,
    ) -> Result<Vec<(usize, u32, Option<TtEntry>)>> {
        let limit = self.sh.cfg.batch_limit;
        let mut out: Vec<(usize, u32, Option<TtEntry>)> = Vec::new();
        let mut have = 0usize;
        while have < missing && out.len() < limit {
            if plan.lln >= plan.v.record.tt_len {
                let p = &self.sh.parts[plan.part];
                let mut j = plan.i + 1;
                let next = loop {
                    if j >= plan.g.header.submodels {
                        break None;
                    }
                    match self.sub_view(p, &plan.g, j).await? {
                        Some(nv) if nv.record.tt_len > 0 => break Some(nv),
                        Some(_) => j += 1,
                        None => return Ok(out),
                    }
                };
                match next {
                    Some(nv) => {
                        plan.i = j;
                        plan.v = nv;
                        plan.lln = 0;
                        // A leaf straddling both intervals heads this TT too.
                        let Some(head) = self.entries(p, &plan.v, 0, 0).await? else {
                            return Ok(out);
                        };
                        if Some(TtEntry::unpack(head[0]).leaf) == plan.last {
                            plan.lln = 1;
                            continue;
                        }
                    }
                    None => {
                        // This partition's TTs end here; its chain must end
                        // too, which processing checks.
                        if !self.plan_next_partition(plan).await? {
                            return Ok(out);
                        }
                    }
                }
            }
            let p = &self.sh.parts[plan.part];
            let upto = (plan.lln + (limit - out.len()) as u32 - 1).min(plan.v.record.tt_len - 1);
            let Some(raw) = self.entries(p, &plan.v, plan.lln, upto).await? else {
                return Ok(out);
            };
            for w in raw {
                let x = TtEntry::unpack(w);
                out.push((plan.part, x.leaf, Some(x)));
                plan.lln += 1;
                plan.last = Some(x.leaf);
                // An empty leaf adds nothing; the batch limit bounds the plan.
                have += x.count as usize;
                if have >= missing || out.len() >= limit {
                    break;
                }
            }
        }
        Ok(out)
    }

    /// Reads the blocks of out-of-line values collected by a scan in one
    /// batch (over every memory node involved). A block that changed since
    /// its leaf was read (updated or deleted meanwhile) is read again
    /// through a GET of its key; a key deleted meanwhile is dropped from
    /// the result.
    async fn resolve_blocks(
        &self,
        out: &mut Vec<(Key, Vec<u8>)>,
        pending: &mut Vec<Pending>,
    ) -> Result<()> {
        if pending.is_empty() {
            return Ok(());
        }
        let mut b = self.ep.batch();
        let idx: Vec<usize> = pending
            .iter()
            .map(|x| {
                b.read(
                    self.sh.parts[x.part].values.at(x.fat.offset),
                    x.fat.block_len(),
                )
            })
            .collect();
        let mut res = b.run().await?;
        let mut gone = Vec::new();
        for (x, i) in pending.drain(..).zip(idx) {
            let bytes = res.take_read(i);
            match parse_block(x.key, x.fat, &bytes) {
                Ok(v) => out[x.at].1 = v,
                Err(_) => match self.get_in(&self.sh.parts[x.part], x.key).await? {
                    Some(v) => out[x.at].1 = v,
                    None => gone.push(x.at),
                },
            }
        }
        for at in gone.into_iter().rev() {
            out.remove(at);
        }
        Ok(())
    }

    /// SCAN by the server from `cursor` (the fallback path).
    async fn scan_by_rpc(
        &self,
        p: &PartClient,
        mut cursor: Key,
        n: usize,
        out: &mut Vec<(Key, Vec<u8>)>,
    ) -> Result<()> {
        while out.len() < n && cursor <= p.hi {
            let mut w = WireWriter::new();
            let want = (n - out.len()).min(MAX_SCAN as usize) as u32;
            w.u8(OP_SCAN)
                .u64(cursor)
                .u32(want)
                .u32(self.generation(p))
                .u8(self.want(p));
            let reply = self.call(p, w.finish()).await?;
            let mut r = WireReader::new(&reply);
            let count = wire(r.count(12))?;
            let mut last = None;
            for _ in 0..count {
                let k = wire(r.u64())?;
                let v = wire(r.bytes())?.to_vec();
                if k < cursor || last.is_some_and(|l| k <= l) || k > p.hi {
                    return Err(KvError::Corrupt(format!(
                        "node {} returned key {k:#x} out of order in a scan",
                        p.node
                    )));
                }
                last = Some(k);
                out.push((k, v));
            }
            let complete = wire(r.bool())?;
            let update = wire(ModelUpdate::decode(&mut r))?;
            wire(r.end())?;
            p.install_update(update);
            if complete {
                return Ok(());
            }
            match last {
                Some(l) if l < u64::MAX => cursor = l + 1,
                _ => return Ok(()),
            }
        }
        Ok(())
    }

    /// GET within partition `p`.
    async fn get_in(&self, p: &PartClient, key: Key) -> Result<Option<Vec<u8>>> {
        // No await inside a `match` on the lookup's result: its temporary
        // would stay in this future's state beside what is moved out of it.
        let mut cause = FallbackCause::Torn;
        for _ in 0..TORN_RETRIES {
            let f = match self.lookup(p, key, self.sh.whole_leaves).await? {
                Lookup::Absent => return Ok(None),
                Lookup::Fallback(c) => {
                    cause = c;
                    break;
                }
                Lookup::Found(f) => f,
            };
            if let Some(v) = self.read_value(p, key, &f).await? {
                return Ok(Some(v));
            }
            ClientStats::bump(&self.stats().value_retries);
        }
        Box::pin(self.fallback_get(p, key, cause)).await
    }

    /// The position hint for UPDATE (§5.3.1): the leaves the cached model
    /// predicts for `key`, `[s, e]` as a GET would read them (step 1 of
    /// Fig. 7), when the cache holds their TT entries (no extra round
    /// trip), written into `out` most likely first: the leaf of the
    /// predicted position, then the others by their distance (in
    /// positions) from it, nearer first, the lower on a tie. Of a
    /// prediction wider than [`MAX_HINT_LEAVES`] leaves, the nearest that
    /// many are looked at. Invalid entries are left out. Returns how many
    /// were written (0: no hint).
    fn hint(&self, p: &PartClient, key: Key, out: &mut [TtEntry; MAX_HINT_LEAVES]) -> usize {
        if !self.sh.cfg.hints {
            return 0;
        }
        let Some(g) = p.cached_gen() else {
            return 0;
        };
        let Some(sub) = g.sub(g.header.route(key)) else {
            return 0;
        };
        let slots = g.header.slots;
        let Some((s, e)) = sub.record.leaf_range(key, slots) else {
            return 0;
        };
        if sub.tt.is_empty() {
            return 0;
        }
        let pos = sub.record.position(key).max(0);
        let n = ((pos / slots as i64) as u32).clamp(s, e);
        let mut len = 0;
        let mut push = |l: u32| {
            let t = TtEntry::unpack(sub.entry(l));
            if t.valid {
                out[len] = t;
                len += 1;
            }
        };
        push(n);
        // Distance from the predicted position to leaf `l`'s positions
        // `[l N, (l + 1) N - 1]`.
        let n_ = slots as i64;
        let below = |l: u32| pos - ((l as i64 + 1) * n_ - 1);
        let above = |l: u32| l as i64 * n_ - pos;
        let (mut lo, mut hi) = (
            n.checked_sub(1).filter(|&l| l >= s),
            n.checked_add(1).filter(|&l| l <= e),
        );
        // At most MAX_HINT_LEAVES leaves looked at (the nearest), so `len`
        // stays within `out` and a wide prediction costs no more.
        for _ in 1..MAX_HINT_LEAVES {
            let l = match (lo, hi) {
                (None, None) => break,
                (Some(l), Some(h)) if below(l) <= above(h) => l,
                (Some(l), None) => l,
                (_, Some(h)) => h,
            };
            if Some(l) == lo {
                lo = l.checked_sub(1).filter(|&x| x >= s);
            } else {
                hi = l.checked_add(1).filter(|&x| x <= e);
            }
            push(l);
        }
        len
    }

    async fn write_rpc(&self, op: u8, key: Key, value: Option<&[u8]>) -> Result<bool> {
        let p = self.sh.part_of(key);
        // Built in the endpoint's request buffer (on `local`, the last small
        // request's allocation, kept), with room for the whole request, so
        // it neither allocates nor grows: `op u8 | key u64 | value bytes |
        // hint count u8 | (leaf u32 | incarnation u32) * count`.
        let room = 1 + 8 + value.map_or(0, |v| 4 + v.len()) + 1 + 8 * MAX_HINT_LEAVES;
        let mut w = WireWriter::append_to(self.ep.request_buffer(0), room);
        w.u8(op).u64(key);
        if let Some(v) = value {
            w.bytes(v);
        }
        let hinted = if op == OP_UPDATE {
            let mut entries = [TtEntry::unpack(0); MAX_HINT_LEAVES];
            let n = self.hint(p, key, &mut entries);
            w.u8(n as u8);
            for e in &entries[..n] {
                w.u32(e.leaf).u32(e.incarnation);
            }
            if n > 0 {
                ClientStats::bump(&self.stats().hints_sent);
                self.stats()
                    .hint_leaves
                    .fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            }
            n > 0
        } else {
            false
        };
        // The endpoint's call future itself (`Client::call`'s `async fn`
        // around it was one more state machine per write).
        let reply = self.ep.call(p.node, p.service, w.finish()).await?;
        let mut r = WireReader::new(&reply);
        let done = wire(r.bool())?;
        if op == OP_UPDATE && wire(r.bool())? && hinted {
            ClientStats::bump(&self.stats().hints_used);
        }
        wire(r.end())?;
        Ok(done)
    }
}

/// A reply that does not parse.
fn wire<T>(r: std::result::Result<T, dmkv_transport::WireError>) -> Result<T> {
    r.map_err(|e| KvError::Transport(e.into()))
}

/// Maximal runs of consecutive numbers in sorted `v`, as (first, last).
fn runs(v: &[u32]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = Vec::new();
    for &x in v {
        match out.last_mut() {
            Some((_, hi)) if *hi + 1 == x => *hi = x,
            _ => out.push((x, x)),
        }
    }
    out
}

/// Whether the leaves read prove `key`'s leaf among them: some key at or
/// below `key` (or the TT's first leaf, which covers the interval's start)
/// and some key above it (or the TT's last leaf).
fn coverage(read: &[(u32, Leaf)], key: Key, s: u32, e: u32, t: u32) -> (bool, bool) {
    let left = s == 0
        || read
            .iter()
            .any(|(_, l)| l.image.keys().keys.iter().any(|&k| k <= key));
    let right = e + 1 >= t
        || read
            .iter()
            .any(|(_, l)| l.image.keys().keys.iter().any(|&k| k > key));
    (left, right)
}

impl KvClient for Client {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        ClientStats::bump(&self.stats().gets);
        let p = self.sh.part_of(key);
        self.get_in(p, key).await
    }

    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.write_rpc(OP_INSERT, key, Some(value)).await
    }

    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.write_rpc(OP_UPDATE, key, Some(value)).await
    }

    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.write_rpc(OP_UPSERT, key, Some(value)).await
    }

    async fn delete(&self, key: Key) -> Result<bool> {
        self.write_rpc(OP_DELETE, key, None).await
    }

    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        ClientStats::bump(&self.stats().scans);
        let parts = &self.sh.parts;
        let mut out = Vec::new();
        let mut part = self.sh.cfg.parts.of(start);
        let mut from = start;
        while out.len() < n && part < parts.len() {
            let mut pending = Vec::new();
            let stop = self.scan_walk(part, from, n, &mut out, &mut pending).await;
            self.resolve_blocks(&mut out, &mut pending).await?;
            match stop? {
                ScanStop::At(q, k) => (part, from) = (q, k),
                ScanStop::Fallback(q, k, cause) => {
                    // From the first key not yet returned, by the server.
                    self.stats().fallback(cause);
                    self.scan_by_rpc(&parts[q], k, n, &mut out).await?;
                    part = q + 1;
                    from = parts.get(part).map_or(0, |x| x.lo);
                }
            }
        }
        out.truncate(n);
        Ok(out)
    }
}

#[cfg(test)]
mod future_size {
    use super::*;

    fn size_of_future<'a, F>(_: impl FnOnce(&'a Client, &'a PartClient) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// The API boxes every GET's future; past 1 KiB it takes mimalloc's
    /// aligned slow path (rolex's `a_get_future_stays_under_one_kib` says
    /// why). Measured 872 bytes: 864 before branch i74, whose `BatchRun`
    /// carries its `deferred` flag (8 bytes with padding; the deferred,
    /// prefetched execution on `local`) (1,392 at cf9a80a; i2 measured 1,328 before
    /// i1's transport changes): the lookup's 792, of which its in-place first read
    /// 448 (the batch is built in a block, so only its run future lives
    /// across the await); the general loop, fetching a model and the
    /// fallback RPC are boxed; `get_in` awaits nothing inside a `match` on
    /// the lookup's result.
    #[test]
    fn a_get_future_stays_under_one_kib() {
        let get = size_of_future(|c, p| c.get_in(p, 0));
        assert!(get < 1024, "Client::get_in's future is {get} bytes");
        assert!(get <= 872, "Client::get_in's future grew to {get} bytes");
    }
}
