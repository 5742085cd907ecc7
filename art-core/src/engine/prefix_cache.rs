//! Keys and values of recently seen token sequences, so that a prompt prefilled once is not
//! prefilled again.
//!
//! GRPO sends a group's rollouts as separate requests with one prompt, and an agent's next turn
//! sends the whole conversation again: without this, each of them pays the full prefill. The
//! scheduler looks a new prompt up here before prefilling it: a prompt seen whole starts from a
//! copy of its cache and its last position's logits (no forward at all); one that extends a
//! cached sequence (a previous turn, a shared system prompt) prefills only what follows it.
//! Entries are copies (no copy-on-write pages yet), evicted least recently used first when the
//! byte budget is exceeded, and tied to the adapter that computed them.

use std::sync::Arc;

use super::error::Result;
use super::lora::{same_adapter, LoraAdapter};
use super::model::KvCache;

/// A shared prefix shorter than this is prefilled again rather than copied: copying saves little,
/// and a request that starts mid-way cannot share a batched forward with others of its length.
pub const MIN_SHARED_PREFIX: usize = 32;

/// A shared prefix is reused in whole blocks of this many positions (a prompt found whole is
/// reused whole). Prompts that share a system prompt and differ soon after it, such as a GRPO
/// step's questions, then start at the same position, and the scheduler prefills them in one
/// batched forward rather than one forward per length of their common prefix (on a GPU, where a
/// forward of a small model costs its launches, 16 forwards of one row took ~0.35 s of a
/// 0.5 s main-job step). The price: at most 15 positions computed again per prompt.
pub const SHARED_PREFIX_BLOCK: usize = 16;

/// Cached token sequences with their keys and values. See the module docs.
pub struct PrefixCache {
    /// Least recently used first.
    entries: Vec<Entry>,
    budget_bytes: usize,
    used_bytes: usize,
}

struct Entry {
    adapter: Option<Arc<LoraAdapter>>,
    tokens: Vec<u32>,
    /// The keys and values of exactly `tokens`.
    cache: KvCache,
    /// The next-token logits after the last of `tokens`, when known (a prefilled prompt; not a
    /// finished completion, whose last token was never fed to the model).
    logits: Option<Vec<f32>>,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.cache.bytes() + self.logits.as_ref().map_or(0, |l| 4 * l.len())
    }
}

/// Where a prompt can start.
pub struct Reuse {
    /// A cache of the prompt's first `cache.len()` tokens, with room to grow.
    pub cache: KvCache,
    /// The logits after the whole prompt, when it was found whole: then nothing is prefilled.
    pub logits: Option<Vec<f32>>,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    /// A cache that holds at most `budget_bytes` of keys, values and logits (0: nothing is kept).
    pub fn new(budget_bytes: usize) -> Self {
        PrefixCache {
            entries: Vec::new(),
            budget_bytes,
            used_bytes: 0,
        }
    }

    /// Whether prompts are shared at all (a budget of 0 turns sharing off, even between the
    /// requests of one step).
    pub fn enabled(&self) -> bool {
        self.budget_bytes > 0
    }

    /// The most its entries may take together.
    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    pub fn used_bytes(&self) -> usize {
        self.used_bytes
    }

    /// How many of `prompt`'s tokens a [`PrefixCache::reuse`] would skip (without touching the
    /// cache's order): the whole prompt, the length of a usable shared prefix, or 0.
    pub fn reusable(&self, adapter: Option<&Arc<LoraAdapter>>, prompt: &[u32]) -> usize {
        self.best(adapter, prompt).map_or(0, |(_, len)| len)
    }

    /// The entry that saves the most of `prompt`, with how many tokens it saves.
    fn best(&self, adapter: Option<&Arc<LoraAdapter>>, prompt: &[u32]) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (i, entry) in self.entries.iter().enumerate().rev() {
            if !same_adapter(entry.adapter.as_ref(), adapter) {
                continue;
            }
            let shared = common_prefix(&entry.tokens, prompt);
            let whole = shared == prompt.len() && entry.tokens.len() == shared;
            let len = if whole && entry.logits.is_some() {
                shared
            } else {
                // At least the prompt's last token must be run, for its logits.
                let usable = shared.min(prompt.len() - 1);
                usable - usable % SHARED_PREFIX_BLOCK
            };
            if len >= MIN_SHARED_PREFIX.min(prompt.len()) && best.is_none_or(|(_, b)| len > b) {
                best = Some((i, len));
            }
        }
        best
    }

    /// A starting point for `prompt` (see [`Reuse`]), or `None` when nothing useful is cached.
    /// The copy's room to grow stops at `max_len` positions, the most its sequence will hold.
    pub fn reuse(
        &mut self,
        adapter: Option<&Arc<LoraAdapter>>,
        prompt: &[u32],
        max_len: usize,
    ) -> Result<Option<Reuse>> {
        let Some((i, len)) = self.best(adapter, prompt) else {
            return Ok(None);
        };
        let entry = self.entries.remove(i);
        let logits = (len == prompt.len())
            .then(|| entry.logits.clone())
            .flatten();
        // Room for the rest of the prompt and some decoding before the buffers grow.
        let room = prompt.len().max(64).next_power_of_two();
        let mut cache = entry
            .cache
            .copy_prefix(len, room.min(max_len).max(prompt.len()))?;
        cache.set_max_len(max_len);
        self.entries.push(entry);
        Ok(Some(Reuse { cache, logits }))
    }

    /// Keeps `cache` (the keys and values of exactly `tokens`) for later requests, evicting the
    /// least recently used entries past the budget. Entries of adapters no longer `loaded` go
    /// first: nothing can ask for them again.
    pub fn insert(
        &mut self,
        adapter: Option<&Arc<LoraAdapter>>,
        tokens: Vec<u32>,
        cache: KvCache,
        logits: Option<Vec<f32>>,
        loaded: impl Fn(&Arc<LoraAdapter>) -> bool,
    ) {
        debug_assert_eq!(tokens.len(), cache.len());
        if tokens.is_empty() {
            return;
        }
        self.entries
            .retain(|e| e.adapter.as_ref().is_none_or(&loaded) && e.tokens != tokens);
        let entry = Entry {
            adapter: adapter.cloned(),
            tokens,
            cache,
            logits,
        };
        self.entries.push(entry);
        self.used_bytes = self.entries.iter().map(Entry::bytes).sum();
        while self.used_bytes > self.budget_bytes {
            let evicted = self.entries.remove(0);
            self.used_bytes -= evicted.bytes();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-layer cache of `tokens.len()` positions whose values are the tokens themselves.
    fn cache_of(tokens: &[u32]) -> KvCache {
        let values: Vec<f32> = tokens.iter().map(|&t| t as f32).collect();
        KvCache::of_values(&values).unwrap()
    }

    fn keys(cache: &KvCache) -> Vec<u32> {
        let keys = cache.first_keys().unwrap();
        keys.iter().map(|&x| x as u32).collect()
    }

    fn prompt(len: usize, salt: u32) -> Vec<u32> {
        (0..len as u32).map(|t| t * 7 + salt).collect()
    }

    #[test]
    fn a_whole_prompt_comes_back_with_its_logits_and_a_longer_one_reuses_its_prefix() {
        let mut cache = PrefixCache::new(usize::MAX);
        let p = prompt(48, 1);
        cache.insert(None, p.clone(), cache_of(&p), Some(vec![0.5; 3]), |_| true);

        let whole = cache.reuse(None, &p, usize::MAX).unwrap().unwrap();
        assert_eq!(whole.logits, Some(vec![0.5; 3]));
        assert_eq!(keys(&whole.cache), p);

        let mut longer = p.clone();
        longer.extend([999, 998]);
        let prefix = cache.reuse(None, &longer, usize::MAX).unwrap().unwrap();
        assert!(prefix.logits.is_none());
        assert_eq!(keys(&prefix.cache), p);
        assert_eq!(cache.reusable(None, &longer), 48);

        // Prompts that leave it at different places start at the same whole block (32), so
        // that they prefill together.
        for shared in 32..48 {
            let other = [&p[..shared], &[999, 998, 997]].concat();
            assert_eq!(cache.reusable(None, &other), 32, "{shared} shared");
            let start = cache.reuse(None, &other, usize::MAX).unwrap().unwrap();
            assert_eq!(keys(&start.cache), p[..32]);
        }
        // A shorter prompt: its last token must still run, for its logits.
        assert_eq!(cache.reusable(None, &p[..47]), 32);
        // Too little in common, or another prompt.
        assert_eq!(cache.reusable(None, &p[..20]), 0);
        assert!(cache
            .reuse(None, &prompt(48, 2), usize::MAX)
            .unwrap()
            .is_none());
    }

    #[test]
    fn the_budget_evicts_the_least_recently_used_entry() {
        let p = prompt(48, 1);
        let q = prompt(48, 3);
        let one_entry = cache_of(&p).bytes();
        let mut cache = PrefixCache::new(2 * one_entry);
        cache.insert(None, p.clone(), cache_of(&p), None, |_| true);
        cache.insert(None, q.clone(), cache_of(&q), None, |_| true);
        assert_eq!(cache.used_bytes(), 2 * one_entry);
        // Using p makes q the least recently used: a third entry evicts q.
        assert!(cache
            .reuse(None, &[p.clone(), vec![5]].concat(), usize::MAX)
            .unwrap()
            .is_some());
        let r = prompt(48, 5);
        cache.insert(None, r.clone(), cache_of(&r), None, |_| true);
        assert_eq!(cache.reusable(None, &[q.clone(), vec![5]].concat()), 0);
        assert_eq!(cache.reusable(None, &[p.clone(), vec![5]].concat()), 48);

        let empty = PrefixCache::new(0);
        assert_eq!(empty.used_bytes(), 0);
        let mut none = PrefixCache::new(0);
        none.insert(None, p.clone(), cache_of(&p), None, |_| true);
        assert_eq!(none.reusable(None, &[p, vec![5]].concat()), 0);
    }
}
