//! CUDA graphs for the decode step: one forward of one token per sequence, captured once per
//! batch-size bucket (and adapter) and replayed with one launch.
//!
//! A decode step of a small model is hundreds of short kernels; launched one by one from the
//! host, the launches (a few microseconds each, plus candle's bookkeeping) and not the GPU set
//! the speed: the 0.5B shape spent ~4.5 ms per step at batch 1, against ~0.3 ms of reading its
//! weights. Replaying a captured graph launches them all at once.
//!
//! What a graph needs is buffers that stay put: the step reads its token ids and the table of
//! cache addresses and positions ([`super::cuda_decode::DecodePlan`]) from buffers owned here,
//! which the host fills before each replay, and writes its logits into one; everything else the
//! forward allocates is allocated and freed inside the graph. Rows beyond the batch (a bucket is
//! rounded up) decode token 0 into a scratch cache. The step itself ([`super::decode_step`])
//! reads the positions from the table on the GPU. The cache addresses may change between steps
//! (a cache grows by doubling): they are data in the table, not part of the graph.
//!
//! A graph reads an adapter's weights at the addresses it was captured with, so graphs through an
//! adapter read a copy of its weights kept here (a slot), and serve every adapter of the same
//! shape: when another comes, its weights are copied into the slot (one device copy per tensor)
//! and the graphs replay as they are. GRPO serves a new adapter every step; capturing graphs per
//! adapter cost about what replaying them saved. Two slots, so that two adapters in use at once
//! (the last step's rollouts finishing beside the next's) do not copy at every step.
//! An adapter's weights must not change in place while it is served: a slot holds a copy.
//! Capturing must not record another thread's work on the same stream: it holds the engine's
//! device gate exclusively ([`crate::engine::Engine::device_gate`]), which the trainer holds
//! shared while it enqueues work. Anything the graphs do not cover (no CUDA, quantized weights,
//! caches longer than the decode kernel takes, more rows than the largest bucket, or a capture
//! that failed) runs the ordinary path. `ART_CUDA_GRAPHS=0` turns them off.

use std::sync::{Arc, Weak};

use super::*;

/// Batch sizes a graph is captured for: a step of `b` rows replays the smallest that holds it.
const BUCKETS: [usize; 16] = [
    1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 256,
];

/// Graphs kept at most; the least recently used goes first.
const MAX_GRAPHS: usize = 32;

/// Adapters' weights kept for the graphs at most (see the module docs).
const MAX_SLOTS: usize = 2;

/// The decode graphs of one scheduler, captured as batch sizes and adapters come.
#[derive(Default)]
pub struct DecodeGraphs {
    captured: Vec<Captured>,
    slots: Vec<AdapterSlot>,
    /// Graphs captured so far.
    captures: u64,
    /// Where padding rows write their keys and values: `[kv_heads, 1, head_dim]`.
    scratch: Option<Tensor>,
    /// Why a capture failed, if one did: the ordinary path runs from then on (logged once).
    broken: Option<String>,
    /// Replays so far, and their clock for the LRU.
    replays: u64,
}

/// A copy of an adapter's weights at fixed addresses, read by the graphs captured through it.
struct AdapterSlot {
    weights: LoraAdapter,
    /// The adapter whose weights it holds now (weak: a replaced adapter is freed, while its
    /// address, which identifies it, is not reused as long as this is kept).
    holds: Weak<LoraAdapter>,
    last_used: u64,
}

impl DecodeGraphs {
    /// Graphs captured so far (each capture costs about what tens of replays save).
    pub fn captures(&self) -> u64 {
        self.captures
    }

    /// The slot that holds `adapter`'s weights, copied into one if none does yet: a new slot
    /// while there is room, else the least recently used one of the same layout (its graphs
    /// serve on), else the least recently used one, whose graphs go with it.
    fn slot_for(&mut self, adapter: &Arc<LoraAdapter>) -> Result<usize> {
        let clock = self.replays;
        let holds = |s: &AdapterSlot| Weak::as_ptr(&s.holds) == Arc::as_ptr(adapter);
        if let Some(i) = self.slots.iter().position(holds) {
            self.slots[i].last_used = clock;
            return Ok(i);
        }
        let least_recent = |slots: &[AdapterSlot], same_layout: bool| {
            (0..slots.len())
                .filter(|&i| !same_layout || slots[i].weights.same_layout(adapter))
                .min_by_key(|&i| slots[i].last_used)
        };
        let i = if self.slots.len() < MAX_SLOTS {
            self.slots.push(AdapterSlot {
                weights: adapter.snapshot()?,
                holds: Weak::new(),
                last_used: clock,
            });
            self.slots.len() - 1
        } else if let Some(i) = least_recent(&self.slots, true) {
            self.slots[i].weights.copy_from(adapter)?;
            i
        } else {
            let i = least_recent(&self.slots, false).expect("MAX_SLOTS > 0");
            self.captured.retain(|c| c.slot != Some(i));
            self.slots[i].weights = adapter.snapshot()?;
            i
        };
        self.slots[i].holds = Arc::downgrade(adapter);
        self.slots[i].last_used = clock;
        Ok(i)
    }
}

struct Captured {
    bucket: usize,
    /// The adapter slot its products read, if any.
    slot: Option<usize>,
    /// Token ids `[bucket, 1]` (u32), filled before each replay.
    ids: Tensor,
    /// The decode plan's table for `bucket` rows (i64), filled before each replay.
    table: Tensor,
    /// The replay's output `[bucket, 1, vocab]` (f32).
    logits: Tensor,
    #[cfg(feature = "cuda")]
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
    last_used: u64,
}

/// The smallest bucket that holds `rows`, if any does.
fn bucket_for(rows: usize) -> Option<usize> {
    BUCKETS.iter().copied().find(|&b| b >= rows)
}

fn enabled() -> bool {
    crate::engine::switches::CUDA_GRAPHS.on()
}

impl Model {
    /// [`Model::forward_cached`] for one new token per sequence (`inputs[b]` continues
    /// `caches[b]`), replayed from a CUDA graph: logits `[B, 1, vocab]` (in the model's dtype:
    /// bf16 on the GPU, which the sampling kernels read as it is), the caches
    /// advanced. `Ok(None)` where graphs do not apply; the caller then runs the ordinary path,
    /// which computes the same. `gate` is the engine's device gate, taken exclusively to capture.
    pub fn forward_decode_graph(
        &self,
        graphs: &mut DecodeGraphs,
        gate: &std::sync::RwLock<()>,
        inputs: &[u32],
        caches: &mut [&mut KvCache],
        adapter: Option<&Arc<LoraAdapter>>,
        quantized: bool,
    ) -> Result<Option<Tensor>> {
        let rows = inputs.len();
        if !cfg!(feature = "cuda")
            || !enabled()
            || graphs.broken.is_some()
            || quantized
            || rows == 0
            || caches.len() != rows
            || !cuda_decode::available(&self.device, self.dtype, self.config.head_dim)
        {
            return Ok(None);
        }
        let Some(bucket) = bucket_for(rows) else {
            return Ok(None);
        };
        if caches.iter().any(|c| c.len + 1 > cuda_decode::MAX_LEN) {
            return Ok(None);
        }
        for &id in inputs {
            self.check_id(id)?;
        }
        self.prepare_scratch(graphs)?;
        let scratch = graphs.scratch.as_ref().expect("prepared");
        let table = self.decode_table(caches, bucket, cuda_decode::device_address(scratch)?)?;
        let mut ids = inputs.to_vec();
        ids.resize(bucket, 0);
        let ids = Tensor::from_vec(ids, (bucket, 1), &self.device)?;
        let table = Tensor::from_vec(table, 2 * (self.layers.len() + 1) * bucket, &self.device)?;

        graphs.replays += 1;
        let clock = graphs.replays;
        let slot = adapter.map(|a| graphs.slot_for(a)).transpose()?;
        let found = graphs
            .captured
            .iter()
            .position(|c| c.bucket == bucket && c.slot == slot);
        let index = match found {
            Some(i) => {
                let c = &graphs.captured[i];
                c.ids.slice_set(&ids, 0, 0)?;
                c.table.slice_set(&table, 0, 0)?;
                i
            }
            None => {
                let _exclusive = gate.write().unwrap_or_else(|e| e.into_inner());
                let weights = slot.map(|i| &graphs.slots[i].weights);
                match self.capture_decode(bucket, slot, weights, &ids, &table) {
                    Ok(c) => {
                        graphs.captures += 1;
                        if graphs.captured.len() >= MAX_GRAPHS {
                            let oldest = (0..graphs.captured.len())
                                .min_by_key(|&i| graphs.captured[i].last_used)
                                .expect("not empty");
                            graphs.captured.swap_remove(oldest);
                        }
                        graphs.captured.push(c);
                        graphs.captured.len() - 1
                    }
                    Err(e) => {
                        // The warm-up ran the step outside a graph and may have written this
                        // step's keys and values already; the ordinary path writes the same.
                        let why = format!("capturing a decode graph failed: {e}");
                        tracing::warn!("{why}; decoding without CUDA graphs from now on");
                        graphs.broken = Some(why);
                        return Ok(None);
                    }
                }
            }
        };
        let c = &mut graphs.captured[index];
        c.last_used = clock;
        launch(c)?;
        for cache in caches.iter_mut() {
            cache.len += 1;
        }
        Ok(Some(c.logits.narrow(0, 0, rows)?))
    }

    /// The padding rows' scratch cache, made once.
    fn prepare_scratch(&self, graphs: &mut DecodeGraphs) -> Result<()> {
        if graphs.scratch.is_none() {
            let (kv, hd) = (self.config.num_key_value_heads, self.config.head_dim);
            graphs.scratch = Some(Tensor::zeros((kv, 1, hd), self.dtype, &self.device)?);
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
impl Model {
    /// The decode step as the graph runs it, from the given buffers.
    fn decode_from_buffers(&self, ids: &Tensor, table: &Tensor, fwd: &Forward) -> Result<Tensor> {
        let plan = DecodePlan {
            table: table.clone(),
            layers: self.layers.len(),
            batch: ids.dim(0)?,
            // The attention kernel's shared memory is sized for the longest cache it takes, so
            // that one graph serves every length.
            max_len: cuda_decode::MAX_LEN,
        };
        self.decode_step(ids, &plan, fwd)
    }

    /// Runs the step once outside a graph (candle caches the small parameter uploads its
    /// kernels make, cuBLAS its workspace), then captures it. The buffers hold this step's ids
    /// and table, so the warm-up computes exactly this step.
    fn capture_decode(
        &self,
        bucket: usize,
        slot: Option<usize>,
        adapter: Option<&LoraAdapter>,
        ids: &Tensor,
        table: &Tensor,
    ) -> Result<Captured> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let fwd = Forward {
            adapter,
            train: false,
            quantized: false,
        };
        let cuda = self.device.as_cuda_device()?;
        let _cache_uploads = cuda.enable_cuda_graph_htod_cache();
        // Own copies: the graph reads these addresses on every replay.
        let ids = ids.copy()?;
        let table = table.copy()?;
        let warm = self.decode_from_buffers(&ids, &table, &fwd)?;
        let logits = warm.copy()?;
        drop(warm);
        self.device.synchronize()?;

        let stream = cuda.cuda_stream();
        let driver = |e: candle_core::cuda_backend::cudarc::driver::DriverError| {
            EngineError::from(candle_core::Error::Msg(format!("CUDA graph: {e}")))
        };
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver)?;
        // Every tensor the forward makes is dropped inside the closure, so its memory is
        // allocated and freed within the graph; only the copy into `logits` leaves it.
        let recorded = (|| -> Result<()> {
            let out = self.decode_from_buffers(&ids, &table, &fwd)?;
            logits.slice_set(&out, 0, 0)?;
            Ok(())
        })();
        // The capture ends whatever happened, or the stream would stay in capture mode.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        recorded?;
        let graph = graph.map_err(driver)?.ok_or_else(|| {
            EngineError::from(candle_core::Error::Msg(
                "CUDA graph: the capture recorded nothing".into(),
            ))
        })?;
        graph.upload().map_err(driver)?;
        Ok(Captured {
            bucket,
            slot,
            ids,
            table,
            logits,
            graph,
            last_used: 0,
        })
    }
}

#[cfg(not(feature = "cuda"))]
impl Model {
    fn capture_decode(
        &self,
        _: usize,
        _: Option<usize>,
        _: Option<&LoraAdapter>,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<Captured> {
        Err(candle_core::Error::Msg("built without the cuda feature".into()).into())
    }
}

#[cfg(feature = "cuda")]
fn launch(c: &Captured) -> Result<()> {
    c.graph.launch().map_err(|e| {
        EngineError::from(candle_core::Error::Msg(format!(
            "CUDA graph launch failed: {e}"
        )))
    })
}

#[cfg(not(feature = "cuda"))]
fn launch(_: &Captured) -> Result<()> {
    unreachable!("graphs are only captured with the cuda feature")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_batch_up_to_the_largest_bucket_has_one_no_smaller_than_itself() {
        let mut previous = 0;
        for rows in 1..=*BUCKETS.last().unwrap() {
            let b = bucket_for(rows).unwrap();
            assert!(b >= rows && b >= previous);
            previous = b;
        }
        assert_eq!(bucket_for(BUCKETS.last().unwrap() + 1), None);
    }
}
