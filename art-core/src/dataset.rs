//! Walking a dataset in training steps, as ART's `iterate_dataset` does: a fixed number of items
//! per step, several epochs, each shuffled the same way every run (the epoch is the seed), and
//! resumable from any global step.

use rand::seq::SliceRandom;
use rand::SeedableRng;

/// The items of one training step, and where it stands.
#[derive(Debug, Clone, PartialEq)]
pub struct DatasetBatch<T> {
    pub items: Vec<T>,
    /// The epoch, from 0.
    pub epoch: usize,
    /// The step over all epochs, from 0: what to resume from.
    pub global_step: usize,
    /// The step within the epoch, from 0.
    pub epoch_step: usize,
}

/// The batches of `dataset`, `groups_per_step` items each (the last of an epoch may have fewer),
/// for `num_epochs` epochs, starting at `initial_step` (a resumed run passes the model's step).
/// Every epoch visits every item once, in an order that depends only on the epoch.
///
/// ```
/// let batches: Vec<_> = art_core::iterate_dataset(&[1, 2, 3, 4, 5], 2, 2, 0).collect();
/// assert_eq!(batches.len(), 6); // 3 steps per epoch
/// assert_eq!(batches[5].global_step, 5);
/// ```
pub fn iterate_dataset<T: Clone>(
    dataset: &[T],
    groups_per_step: usize,
    num_epochs: usize,
    initial_step: usize,
) -> impl Iterator<Item = DatasetBatch<T>> + '_ {
    let per_step = groups_per_step.max(1);
    let steps_per_epoch = dataset.len().div_ceil(per_step);
    (initial_step / steps_per_epoch.max(1)..num_epochs)
        .filter(move |_| steps_per_epoch > 0)
        .flat_map(move |epoch| {
            let mut order: Vec<usize> = (0..dataset.len()).collect();
            order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(epoch as u64));
            (0..steps_per_epoch)
                .map(move |epoch_step| (epoch, epoch_step, order.clone()))
                .filter(move |&(_, epoch_step, _)| {
                    epoch * steps_per_epoch + epoch_step >= initial_step
                })
        })
        .map(move |(epoch, epoch_step, order)| {
            let start = epoch_step * per_step;
            let end = (start + per_step).min(order.len());
            DatasetBatch {
                items: order[start..end]
                    .iter()
                    .map(|&i| dataset[i].clone())
                    .collect(),
                epoch,
                global_step: epoch * steps_per_epoch + epoch_step,
                epoch_step,
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_epoch_visits_every_item_once_in_a_fixed_order() {
        let data: Vec<u32> = (0..10).collect();
        let batches: Vec<_> = iterate_dataset(&data, 4, 3, 0).collect();
        assert_eq!(batches.len(), 9);
        for epoch in 0..3 {
            let mut seen: Vec<u32> = batches[epoch * 3..epoch * 3 + 3]
                .iter()
                .flat_map(|b| b.items.clone())
                .collect();
            assert_eq!(batches[epoch * 3 + 2].items.len(), 2);
            seen.sort();
            assert_eq!(seen, data);
        }
        assert_ne!(
            batches[0].items, batches[3].items,
            "epochs are shuffled apart"
        );
        assert_eq!(
            batches,
            iterate_dataset(&data, 4, 3, 0).collect::<Vec<_>>(),
            "and the same way every run"
        );
        let steps: Vec<_> = batches
            .iter()
            .map(|b| (b.epoch, b.epoch_step, b.global_step))
            .collect();
        assert_eq!(steps[4], (1, 1, 4));
    }

    #[test]
    fn resuming_at_a_step_gives_the_rest_of_the_same_walk() {
        let data: Vec<u32> = (0..7).collect();
        let all: Vec<_> = iterate_dataset(&data, 3, 2, 0).collect();
        for initial in 0..=all.len() {
            let resumed: Vec<_> = iterate_dataset(&data, 3, 2, initial).collect();
            assert_eq!(resumed, all[initial..], "from step {initial}");
        }
        assert_eq!(iterate_dataset::<u32>(&[], 3, 2, 0).count(), 0);
        assert_eq!(
            iterate_dataset(&data, 0, 1, 0).count(),
            7,
            "at least one item a step"
        );
    }
}
