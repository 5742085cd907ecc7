//! A sequence's key/value cache: every layer's keys and values so far, in buffers that grow by
//! doubling and are written in place.

use candle_core::{DType, Device, Result, Tensor};

/// The keys and values one sequence has seen, for every layer. Storage grows by doubling, and
/// new entries are written in place.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub(super) layers: Vec<LayerKv>,
    pub(super) len: usize,
}

#[derive(Debug, Clone, Default)]
pub(super) struct LayerKv {
    /// `[1, kv_heads, capacity, head_dim]`, valid up to the cache's `len`.
    pub(super) k: Option<Tensor>,
    pub(super) v: Option<Tensor>,
}

impl KvCache {
    pub fn new(num_layers: usize) -> Self {
        KvCache {
            layers: vec![LayerKv::default(); num_layers],
            len: 0,
        }
    }

    /// Tokens cached so far (the position of the next token).
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// An independent copy (for sampling several continuations of one prompt).
    pub fn deep_clone(&self) -> Result<Self> {
        let capacity = match self.layers.first().and_then(|l| l.k.as_ref()) {
            Some(k) => k.dim(2)?,
            None => self.len,
        };
        self.copy_prefix(self.len, capacity)
    }

    /// An independent copy of the first `len` positions, in buffers of `capacity >= len`
    /// positions (`len` for a copy kept aside, more for one that will grow).
    pub fn copy_prefix(&self, len: usize, capacity: usize) -> Result<Self> {
        assert!(
            len <= self.len && len <= capacity,
            "copy_prefix past the cache"
        );
        let copy = |t: &Option<Tensor>| -> Result<Option<Tensor>> {
            let Some(t) = t else { return Ok(None) };
            let (one, kv, _, hd) = t.dims4()?;
            let buf = Tensor::zeros((one, kv, capacity, hd), t.dtype(), t.device())?;
            // (A prefix of a longer buffer is a strided view, which slice_set cannot read.)
            buf.slice_set(&t.narrow(2, 0, len)?.contiguous()?, 2, 0)?;
            Ok(Some(buf))
        };
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerKv {
                    k: copy(&l.k)?,
                    v: copy(&l.v)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(KvCache { layers, len })
    }

    /// Bytes its buffers hold (their capacity, not just the positions in use).
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .flat_map(|l| [&l.k, &l.v])
            .flatten()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }
}

impl LayerKv {
    /// Writes `k`, `v` (`[1, kv, L, hd]`) at position `start` and returns views of everything
    /// cached so far, `[1, kv, start + L, hd]`.
    pub(super) fn append(
        &mut self,
        start: usize,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let new_len = start + k.dim(2)?;
        let (_, kv, _, hd) = k.dims4()?;
        self.reserve(new_len, kv, hd, k.dtype(), k.device())?;
        let (kb, vb) = (self.k.as_ref().unwrap(), self.v.as_ref().unwrap());
        kb.slice_set(&k.contiguous()?, 2, start)?;
        vb.slice_set(&v.contiguous()?, 2, start)?;
        Ok((kb.narrow(2, 0, new_len)?, vb.narrow(2, 0, new_len)?))
    }
}

impl LayerKv {
    /// Makes room for `len` positions (`[1, kv, >= len, hd]` buffers), keeping what is cached.
    pub(super) fn reserve(
        &mut self,
        len: usize,
        kv: usize,
        hd: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<()> {
        let capacity = self.k.as_ref().map(|t| t.dim(2)).transpose()?.unwrap_or(0);
        if len > capacity {
            let new_capacity = len.max(2 * capacity).max(64);
            let grow = |old: &Option<Tensor>| -> Result<Tensor> {
                let buf = Tensor::zeros((1, kv, new_capacity, hd), dtype, device)?;
                if let Some(old) = old {
                    buf.slice_set(old, 2, 0)?;
                }
                Ok(buf)
            };
            self.k = Some(grow(&self.k)?);
            self.v = Some(grow(&self.v)?);
        }
        Ok(())
    }
}

#[cfg(test)]
impl KvCache {
    /// A one-layer cache holding `values` as both keys and values (`[1, 1, len, 1]`).
    pub(crate) fn of_values(values: &[f32]) -> Result<Self> {
        let kv = Tensor::from_vec(values.to_vec(), (1, 1, values.len(), 1), &Device::Cpu)?;
        let mut cache = KvCache::new(1);
        cache.layers[0].append(0, &kv, &kv)?;
        cache.len = values.len();
        Ok(cache)
    }

    /// The first layer's keys in use, flattened.
    pub(crate) fn first_keys(&self) -> Result<Vec<f32>> {
        let k = self.layers[0].k.as_ref().expect("a filled cache");
        k.narrow(2, 0, self.len)?
            .to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1()
    }
}
