//! A sequence's key/value cache: every layer's keys and values so far, in one buffer that grows
//! by doubling and is written in place.
//!
//! One buffer per sequence, not one per layer: copying a cache (a group's rollouts each start
//! from their prompt's, the prefix cache hands out copies) and growing it are then a few
//! operations whatever the depth of the model, instead of a few per layer. On a GPU each
//! operation is a kernel launch and an allocation, and a 30-layer model's 128 rollouts a step made
//! tens of thousands of them.

use candle_core::{DType, Device, Result, Tensor};

/// The keys and values one sequence has seen, for every layer. Storage grows by doubling (up to
/// the most positions the sequence can reach, when that is known), and new entries are written
/// in place.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    /// `[layers, 2, kv_heads, capacity, head_dim]`: each layer's keys, then its values, valid
    /// up to `len`. Made at the first write, when the shape and dtype are known.
    buf: Option<Tensor>,
    num_layers: usize,
    pub(super) len: usize,
    /// The most positions the sequence will ever hold (its prompt and `max_tokens`), past
    /// which growing by doubling would only waste memory; `None`: unknown.
    max_len: Option<usize>,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            buf: None,
            num_layers,
            len: 0,
            max_len: None,
        }
    }

    /// Caps the buffer's growth at `max_len` positions, the most the sequence will hold.
    pub fn set_max_len(&mut self, max_len: usize) {
        self.max_len = Some(max_len);
    }

    /// The capacity the buffer has once it holds `len` positions (see [`grown_capacity`]).
    pub fn grown_for(&self, len: usize) -> usize {
        grown_capacity(self.capacity(), len, self.max_len)
    }

    /// Tokens cached so far (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Positions the buffer holds before it must grow.
    pub fn capacity(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.dims()[3])
    }

    /// An independent copy of the first `len` positions, in a buffer of `capacity >= len`
    /// positions (`len` for a copy kept aside, more for one that will grow).
    pub fn copy_prefix(&self, len: usize, capacity: usize) -> Result<Self> {
        assert!(
            len <= self.len && len <= capacity,
            "copy_prefix past the cache"
        );
        let buf = match &self.buf {
            Some(buf) => Some(copy_positions(buf, len, capacity)?),
            None => None,
        };
        Ok(KvCache {
            buf,
            num_layers: self.num_layers,
            len,
            max_len: self.max_len,
        })
    }

    /// Bytes its buffer holds (its capacity, not just the positions in use).
    pub fn bytes(&self) -> usize {
        self.buf
            .as_ref()
            .map_or(0, |b| b.elem_count() * b.dtype().size_in_bytes())
    }

    /// Makes room for `len` positions, keeping what is cached; the buffer is made here for a
    /// model with `kv` key/value heads of `hd` values.
    pub(super) fn reserve(
        &mut self,
        len: usize,
        kv: usize,
        hd: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<()> {
        let capacity = self.capacity();
        if len <= capacity {
            return Ok(());
        }
        let new_capacity = self.grown_for(len);
        self.buf = Some(match &self.buf {
            Some(old) => copy_positions(old, self.len, new_capacity)?,
            None => Tensor::zeros((self.num_layers, 2, kv, new_capacity, hd), dtype, device)?,
        });
        Ok(())
    }

    /// The whole buffer, `[layers, 2, kv, capacity, hd]` (`None` before the first write).
    pub(super) fn buffer(&self) -> Option<&Tensor> {
        self.buf.as_ref()
    }

    /// Where layer `layer`'s keys and values start in [`Self::buffer`], in elements: the
    /// offsets of [`Self::layer`]'s views, for kernels that take addresses (the CUDA decode's
    /// table).
    pub(super) fn layer_offsets(&self, layer: usize) -> (usize, usize) {
        let part: usize = self
            .buf
            .as_ref()
            .map_or(0, |b| b.dims()[2..].iter().product());
        (2 * layer * part, (2 * layer + 1) * part)
    }

    /// Layer `layer`'s keys and values, `[1, kv, capacity, hd]` each: contiguous views into
    /// the buffer (written in place through them). `None` before the first write.
    pub(super) fn layer(&self, layer: usize) -> Result<Option<(Tensor, Tensor)>> {
        let Some(buf) = &self.buf else {
            return Ok(None);
        };
        let part = |which: usize| buf.get(layer)?.narrow(0, which, 1);
        Ok(Some((part(0)?, part(1)?)))
    }

    /// Writes `k`, `v` (`[1, kv, L, hd]`) of layer `layer` at position `start` and returns
    /// views of that layer's positions so far, `[1, kv, start + L, hd]`. The cache's `len`
    /// moves once every layer is written (by the caller).
    pub(super) fn append(
        &mut self,
        layer: usize,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let new_len = start + k.dim(2)?;
        let (_, kv, _, hd) = k.dims4()?;
        self.reserve(new_len, kv, hd, k.dtype(), k.device())?;
        let (kb, vb) = self.layer(layer)?.expect("reserved");
        kb.slice_set(&k.contiguous()?, 2, start)?;
        vb.slice_set(&v.contiguous()?, 2, start)?;
        Ok((kb.narrow(2, 0, new_len)?, vb.narrow(2, 0, new_len)?))
    }
}

/// The capacity a buffer of `capacity` positions has once it holds `len`: itself if `len` fits,
/// else doubled (at least 64 positions), but no more than `max_len` (the most it will hold)
/// and no less than `len`. The scheduler's memory accounting predicts growth with it.
pub fn grown_capacity(capacity: usize, len: usize, max_len: Option<usize>) -> usize {
    if len <= capacity {
        capacity
    } else {
        let doubled = len.max(2 * capacity).max(64);
        doubled.min(max_len.unwrap_or(usize::MAX)).max(len)
    }
}

/// A new buffer of `capacity` positions holding the first `len` of `buf`'s: one allocation and
/// two copies for every layer at once.
fn copy_positions(buf: &Tensor, len: usize, capacity: usize) -> Result<Tensor> {
    let (layers, two, kv, _, hd) = buf.dims5()?;
    let copy = Tensor::zeros((layers, two, kv, capacity, hd), buf.dtype(), buf.device())?;
    if len > 0 {
        // (A prefix of the longer buffer is a strided view, which slice_set cannot read.)
        copy.slice_set(&buf.narrow(3, 0, len)?.contiguous()?, 3, 0)?;
    }
    Ok(copy)
}

#[cfg(test)]
impl KvCache {
    /// A one-layer cache holding `values` as both keys and values (`[1, 1, len, 1]`).
    pub(crate) fn of_values(values: &[f32]) -> Result<Self> {
        let kv = Tensor::from_vec(values.to_vec(), (1, 1, values.len(), 1), &Device::Cpu)?;
        let mut cache = KvCache::new(1);
        cache.append(0, 0, &kv, &kv)?;
        cache.len = values.len();
        Ok(cache)
    }

    /// The first layer's keys in use, flattened.
    pub(crate) fn first_keys(&self) -> Result<Vec<f32>> {
        let (k, _) = self.layer(0)?.expect("a filled cache");
        k.narrow(2, 0, self.len)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Growth doubles, but not past the most positions the sequence will hold.
    #[test]
    fn growth_stops_at_the_sequences_longest() {
        assert_eq!(grown_capacity(0, 10, None), 64);
        assert_eq!(grown_capacity(64, 65, None), 128);
        assert_eq!(grown_capacity(0, 10, Some(30)), 30);
        assert_eq!(grown_capacity(70, 71, Some(100)), 100);
        assert_eq!(
            grown_capacity(100, 100, Some(90)),
            100,
            "what it has, it keeps"
        );
        assert_eq!(
            grown_capacity(70, 120, Some(100)),
            120,
            "never less than asked"
        );
        let kv = Tensor::zeros((1, 1, 70, 2), DType::F32, &Device::Cpu).unwrap();
        let mut cache = KvCache::new(1);
        cache.set_max_len(100);
        cache.append(0, 0, &kv, &kv).unwrap();
        cache.len = 70;
        assert_eq!(cache.capacity(), 70);
        let more = kv.narrow(2, 0, 20).unwrap();
        cache.append(0, 70, &more, &more).unwrap();
        assert_eq!(cache.capacity(), 100);
        let copy = cache.copy_prefix(40, 60).unwrap();
        assert_eq!(copy.grown_for(61), 100, "a copy keeps the cap");
    }

    /// Keys and values of two layers written through `append`, then copied, grown and read back
    /// layer by layer: every layer keeps its own positions.
    #[test]
    fn layers_keep_their_positions_through_copies_and_growth() {
        let dev = Device::Cpu;
        let entry = |layer: usize, which: usize, pos: usize, j: usize| {
            (1000 * layer + 100 * which + 10 * pos + j) as f32
        };
        let block = |layer: usize, which: usize, start: usize, n: usize| {
            let data: Vec<f32> = (0..2)
                .flat_map(|_head| (start..start + n).flat_map(move |p| (0..3).map(move |j| (p, j))))
                .map(|(p, j)| entry(layer, which, p, j))
                .collect();
            Tensor::from_vec(data, (1, 2, n, 3), &dev).unwrap()
        };
        let mut cache = KvCache::new(2);
        for (start, n) in [(0, 5), (5, 70)] {
            for layer in 0..2 {
                let (k, v) = cache
                    .append(
                        layer,
                        start,
                        &block(layer, 0, start, n),
                        &block(layer, 1, start, n),
                    )
                    .unwrap();
                assert_eq!(k.dims(), &[1, 2, start + n, 3]);
                assert_eq!(v.dims(), &[1, 2, start + n, 3]);
            }
            cache.len = start + n;
        }
        assert_eq!(cache.capacity(), 128, "64, then doubled");
        let copy = cache.copy_prefix(40, 40).unwrap();
        let grown = cache.copy_prefix(75, 128).unwrap();
        for (c, len) in [(&cache, 75), (&copy, 40), (&grown, 75)] {
            for layer in 0..2 {
                let (k, v) = c.layer(layer).unwrap().unwrap();
                for (which, t) in [(0, k), (1, v)] {
                    let got: Vec<f32> = t
                        .narrow(2, 0, len)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    let want = block(layer, which, 0, len)
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f32>()
                        .unwrap();
                    assert_eq!(got, want, "layer {layer}, which {which}, len {len}");
                }
            }
        }
        assert_eq!(copy.bytes(), 2 * 2 * 2 * 40 * 3 * 4);
        // The offsets the CUDA decode's table is built from are those of the views read above.
        for c in [&cache, &copy] {
            for layer in 0..2 {
                let (k, v) = c.layer(layer).unwrap().unwrap();
                let offsets = (k.layout().start_offset(), v.layout().start_offset());
                assert_eq!(c.layer_offsets(layer), offsets);
            }
        }
    }
}
