//! Packed rows for training forwards: several sequences in one row, so that a batch of uneven
//! lengths computes little padding, and sequences that begin alike (the rollouts of one group
//! share their prompt) laid out as one block, their common prefix computed once and read by each.
//!
//! A block is a prefix followed by continuations. The prefix attends to itself causally; each
//! continuation attends to the whole prefix and to itself causally, its rotary positions counted
//! on from the prefix's end, so that every sequence sees exactly the keys, at exactly the
//! positions, that it would see in a row of its own. The bound is an additive mask of 0 and -inf
//! added to the scores before the causal softmax: masked probabilities are exactly 0, as are
//! their gradients.

use super::*;

/// One block of a packed row: `prefix` positions shared by every continuation, then the
/// continuations' own positions one after another. A lone sequence is a prefix without
/// continuations (or a prefix and one continuation: the same thing).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackedBlock {
    pub prefix: usize,
    pub continuations: Vec<usize>,
}

impl PackedBlock {
    /// A sequence of `len` positions on its own.
    pub fn alone(len: usize) -> Self {
        PackedBlock {
            prefix: len,
            continuations: Vec::new(),
        }
    }

    /// The positions the block takes in its row.
    pub fn len(&self) -> usize {
        self.prefix + self.continuations.iter().sum::<usize>()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the block is more than one plain causal sequence.
    fn is_shared(&self) -> bool {
        self.continuations.iter().filter(|&&c| c > 0).count() > 1
    }
}

/// How sequences sit in the rows of a training forward: `rows[b]` are the blocks laid out one
/// after another in row `b`. Positions after them are padding; their outputs mean nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackedRows {
    pub rows: Vec<Vec<PackedBlock>>,
}

/// What one position of a packed row sees: keys `prefix.0..prefix.1` (the shared prefix of a
/// continuation; empty elsewhere) and `own..=` itself.
#[derive(Debug, Clone, Copy)]
struct Sight {
    prefix: (usize, usize),
    own: usize,
}

impl PackedRows {
    /// Whether any row holds more than one plain sequence (otherwise rows are plain
    /// right-padded sequences and need no mask).
    pub fn is_packed(&self) -> bool {
        self.rows
            .iter()
            .any(|r| r.len() > 1 || r.iter().any(PackedBlock::is_shared))
    }

    /// Each position's rotary position and what it sees, row after row, for rows of `width`
    /// positions. Padding continues as one more sequence.
    fn layout(&self, width: usize) -> Result<(Vec<usize>, Vec<Sight>)> {
        let mut positions = Vec::with_capacity(self.rows.len() * width);
        let mut sights = Vec::with_capacity(positions.capacity());
        for (b, blocks) in self.rows.iter().enumerate() {
            let used: usize = blocks.iter().map(PackedBlock::len).sum();
            if used > width {
                return Err(EngineError::InvalidRequest(format!(
                    "packed row {b}: blocks of {used} positions do not fit a row of {width}"
                )));
            }
            let padding = PackedBlock::alone(width - used);
            let mut start = 0;
            for block in blocks.iter().chain(std::iter::once(&padding)) {
                let prefix = (start, start + block.prefix);
                positions.extend(0..block.prefix);
                sights.extend((0..block.prefix).map(|_| Sight {
                    prefix: (start, start),
                    own: start,
                }));
                start = prefix.1;
                for &len in &block.continuations {
                    positions.extend(block.prefix..block.prefix + len);
                    sights.extend((0..len).map(|_| Sight { prefix, own: start }));
                    start += len;
                }
            }
        }
        Ok((positions, sights))
    }
}

/// The attention bounds of packed rows as an additive mask `[B, 1, 1, L, L]` in the scores'
/// dtype (0 where a query sees the key, -inf elsewhere, causality included), broadcast over the
/// key heads and the query heads stacked on each.
#[derive(Debug, Clone)]
pub(super) struct Segments {
    pub(super) mask: Tensor,
}

impl Segments {
    /// Built on the device from four numbers per query (its index and the bounds of what it
    /// sees): the host never writes the `B x L x L` mask, which for long rows on a GPU would
    /// cost more than the attention it masks.
    fn new(
        sights: &[Sight],
        (b, l): (usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let column = |f: &dyn Fn(usize, &Sight) -> usize| -> Result<Tensor> {
            let values: Vec<u32> = sights
                .iter()
                .enumerate()
                .map(|(row, sight)| f(row % l, sight) as u32)
                .collect();
            Ok(Tensor::from_vec(values, (b, l, 1), device)?)
        };
        let query = column(&|q, _| q)?;
        let own = column(&|_, s| s.own)?;
        let prefix_start = column(&|_, s| s.prefix.0)?;
        let prefix_end = column(&|_, s| s.prefix.1)?;
        let keys = Tensor::arange(0u32, l as u32, device)?.reshape((1, 1, l))?;
        let within = |low: &Tensor, high: &Tensor, inclusive: bool| -> Result<Tensor> {
            let above = keys.broadcast_ge(low)?;
            let below = if inclusive {
                keys.broadcast_le(high)?
            } else {
                keys.broadcast_lt(high)?
            };
            Ok((above * below)?)
        };
        // u8 0/1 flags; one of the two ranges is enough.
        let seen =
            within(&own, &query, true)?.maximum(&within(&prefix_start, &prefix_end, false)?)?;
        let zero = Tensor::zeros((b, l, l), dtype, device)?;
        let hidden = Tensor::full(f32::NEG_INFINITY, (b, l, l), device)?.to_dtype(dtype)?;
        let mask = seen.where_cond(&zero, &hidden)?.reshape((b, 1, 1, l, l))?;
        Ok(Segments { mask })
    }
}

impl Model {
    /// The rotary tables (and, for packed rows, the attention bounds) of a training forward over
    /// rows `[B, L]`: every row one sequence from position 0 without `packing` or when nothing is
    /// packed.
    pub(super) fn row_tables(
        &self,
        (b, l): (usize, usize),
        packing: Option<&PackedRows>,
    ) -> Result<RopeTables> {
        let Some(packing) = packing.filter(|p| p.is_packed()) else {
            return self.rotary.tables(&vec![0; b], l, self.dtype, &self.device);
        };
        if packing.rows.len() != b {
            return Err(EngineError::InvalidRequest(format!(
                "packing describes {} rows for a forward of {b}",
                packing.rows.len()
            )));
        }
        let (positions, sights) = packing.layout(l)?;
        let mut tables = self
            .rotary
            .tables_at(&positions, (b, l), self.dtype, &self.device)?;
        tables.segments = Some(Segments::new(&sights, (b, l), self.dtype, &self.device)?);
        Ok(tables)
    }
}
