//! Turning logits into tokens: temperature, top-k, top-p, seeded randomness, and the
//! log-probabilities that a trainer needs.
//!
//! **Which log-probability is reported.** For each generated token, `logprob` is the
//! log-softmax of `logits / temperature` at that token, over the *whole* vocabulary: the
//! temperature is applied, top-k / top-p truncation is not. With `temperature == 0` (greedy)
//! it is the log-softmax of the raw logits. `top_logprobs` come from the same distribution.
//! At temperature 1 this is exactly what the trainer's own forward computes for the token.
//! Under a [`Constraint`] the logits of disallowed tokens are -inf before the sampler sees them,
//! so the log-probabilities are those of the masked distribution (see [`super::constraint`]).

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::constraint::Constraint;

/// How to sample one completion (OpenAI's request fields).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f64,
    /// Keep the smallest set of most likely tokens whose probability adds up to `top_p` (1 = all).
    pub top_p: f64,
    /// Keep only the `top_k` most likely tokens (0 = all).
    pub top_k: usize,
    /// Makes sampling reproducible: the same request with the same seed gives the same tokens.
    pub seed: Option<u64>,
    /// Upper bound on generated tokens (the stop token, if sampled, counts).
    pub max_tokens: usize,
    /// Extra token ids that end generation, besides the model's end-of-sequence ids.
    pub stop_token_ids: Vec<u32>,
    /// Strings that end generation; the returned text stops before the first one.
    pub stop: Vec<String>,
    /// Completions to sample from the one prompt.
    pub n: usize,
    /// Report each generated token's log-probability.
    pub logprobs: bool,
    /// How many of the most likely alternatives to report per token (0..=20 in OpenAI's API).
    pub top_logprobs: usize,
    /// Keep generating past the model's end-of-sequence ids (until `max_tokens` or a stop).
    /// Ignored under a `constraint`, which decides where the completion ends.
    pub ignore_eos: bool,
    /// Structured output: every completion must match this (JSON schema, JSON object, Lark
    /// grammar, regex). Checked when the request is added.
    pub constraint: Option<Constraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 256,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            n: 1,
            logprobs: false,
            top_logprobs: 0,
            ignore_eos: false,
            constraint: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding of up to `max_tokens` tokens.
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }

    pub(crate) fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if self.n == 0 {
            return Err("n must be at least 1".into());
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        Ok(())
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct SampledToken {
    pub id: u32,
    /// See the module docs for which distribution this is taken from.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first (empty unless
    /// requested).
    pub top_logprobs: Vec<(u32, f32)>,
}

/// Samples tokens for one sequence; owns that sequence's random state.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// A seed per completion: completion `i` of a seeded request uses its own stream, so `n > 1`
/// gives different samples yet every one is reproducible.
fn mix_seed(seed: u64, index: u64) -> u64 {
    // SplitMix64 finaliser over seed + index.
    let mut z = seed
        .wrapping_add(index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
        .wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Sampler {
    /// A sampler for completion `index` of a request.
    pub fn new(params: SamplingParams, index: usize) -> Self {
        let rng = match params.seed {
            Some(seed) => StdRng::seed_from_u64(mix_seed(seed, index as u64)),
            None => StdRng::from_rng(&mut rand::rng()),
        };
        Sampler { params, rng }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Prepares this step's draw for the device (`cuda_sample`), which then does what
    /// [`Sampler::sample`] would do on the host, with the same random number: `None` when the
    /// parameters need the host (top-k, top-p, top log-probabilities). Consumes the random
    /// number `sample` would (none for greedy), so a seeded stream goes on as on the host.
    pub(crate) fn device_draw(&mut self) -> Option<DeviceDraw> {
        let p = &self.params;
        if p.top_k != 0 || p.top_p < 1.0 || p.top_logprobs > 0 {
            return None;
        }
        let greedy = p.temperature == 0.0;
        Some(DeviceDraw {
            greedy,
            inv_t: if greedy {
                1.0
            } else {
                (1.0 / p.temperature) as f32
            },
            u: if greedy {
                0.0
            } else {
                self.rng.random::<f64>()
            },
        })
    }
}

/// One row's draw as the device makes it ([`Sampler::device_draw`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct DeviceDraw {
    /// Argmax instead of a draw.
    pub greedy: bool,
    /// 1 / temperature (1 for greedy).
    pub inv_t: f32,
    /// The uniform number in [0, 1) of the draw (0 for greedy).
    pub u: f64,
}

/// What the device reports for one row: the token, the row's largest logit, the sum of
/// `exp((l - max) * inv_t)` over the row, and the token's logit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct DeviceResult {
    pub id: u32,
    pub max: f32,
    pub sum: f64,
    pub logit: f32,
}

impl DeviceDraw {
    /// The row's draw on the host: what the device computes, by [`Sampler::sample`]'s arithmetic.
    pub(crate) fn reference(&self, logits: &[f32]) -> DeviceResult {
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits
            .iter()
            .map(|&l| (((l - max) * self.inv_t) as f64).exp())
            .sum();
        let id = if self.greedy {
            argmax(logits)
        } else {
            inverse_cdf(logits, max, self.inv_t, sum, self.u)
        };
        DeviceResult {
            id: id as u32,
            max,
            sum,
            logit: logits[id],
        }
    }

    /// The sampled token, its log-probability computed as [`Sampler::sample`] does.
    pub(crate) fn token(&self, r: DeviceResult) -> SampledToken {
        let log_z = r.sum.ln() as f32;
        SampledToken {
            id: r.id,
            logprob: (r.logit - r.max) * self.inv_t - log_z,
            top_logprobs: Vec::new(),
        }
    }
}

impl Sampler {
    /// Picks the next token from one row of logits.
    pub fn sample(&mut self, logits: &[f32]) -> SampledToken {
        let greedy = self.params.temperature == 0.0;
        let inv_t = if greedy {
            1.0
        } else {
            (1.0 / self.params.temperature) as f32
        };
        // log-softmax of logits / T, computed stably.
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let sum: f64 = logits
            .iter()
            .map(|&l| (((l - max) * inv_t) as f64).exp())
            .sum();
        let log_z = sum.ln() as f32;
        let logprob = |id: usize| (logits[id] - max) * inv_t - log_z;

        let id = if greedy {
            argmax(logits)
        } else {
            self.draw(logits, max, inv_t, sum)
        };
        let top_logprobs = if self.params.top_logprobs > 0 {
            top_k_indices(logits, self.params.top_logprobs)
                .into_iter()
                .map(|i| (i as u32, logprob(i)))
                // Tokens masked out by a constraint (-inf) are not alternatives.
                .filter(|(_, lp)| lp.is_finite())
                .collect()
        } else {
            Vec::new()
        };
        SampledToken {
            id: id as u32,
            logprob: logprob(id),
            top_logprobs,
        }
    }

    /// A draw from softmax(logits / T) restricted by top-k and top-p; `total` is the sum of
    /// the row's weights `exp((l - max) / T)`, which [`Sampler::sample`] has already computed.
    fn draw(&mut self, logits: &[f32], max: f32, inv_t: f32, total: f64) -> usize {
        let (k, p) = (self.params.top_k, self.params.top_p);
        let weight = |l: f32| (((l - max) * inv_t) as f64).exp();
        if k == 0 && p >= 1.0 {
            let u = self.rng.random::<f64>();
            return inverse_cdf(logits, max, inv_t, total, u);
        }
        // Candidates in descending order. Top-p usually needs only a few hundred of them:
        // try a bounded prefix first, and sort everything only when that does not reach p.
        let limit = if k > 0 {
            k.min(logits.len())
        } else {
            logits.len()
        };
        let mut prefix = limit.min(256);
        let candidates = loop {
            let cand = top_k_indices(logits, prefix);
            let mass: f64 = cand.iter().map(|&i| weight(logits[i])).sum::<f64>() / total;
            if prefix == limit || mass >= p {
                break cand;
            }
            prefix = (prefix * 8).min(limit);
        };
        let mut kept = Vec::with_capacity(candidates.len());
        let mut cum = 0.0;
        for &i in &candidates {
            let w = weight(logits[i]);
            kept.push((i, w));
            cum += w / total;
            if cum >= p {
                break;
            }
        }
        let kept_total: f64 = kept.iter().map(|&(_, w)| w).sum();
        let mut u = self.rng.random::<f64>() * kept_total;
        for &(i, w) in &kept {
            u -= w;
            if u <= 0.0 {
                return i;
            }
        }
        kept[0].0
    }
}

/// A draw from softmax(logits / T) (`inv_t` = 1 / T, `max` the largest logit, `total` the sum of
/// the weights `exp((l - max) / T)`) for a uniform `u` in [0, 1): the first token at which the
/// running sum of the weights reaches `u` times their total. What [`Sampler::sample`] does
/// without top-k or top-p, and what the CUDA sampling kernel computes (`cuda_sample`).
pub(crate) fn inverse_cdf(logits: &[f32], max: f32, inv_t: f32, total: f64, u: f64) -> usize {
    let weight = |l: f32| (((l - max) * inv_t) as f64).exp();
    let mut u = u * total;
    for (i, &l) in logits.iter().enumerate() {
        u -= weight(l);
        if u <= 0.0 {
            return i;
        }
    }
    argmax(logits)
}

/// Index of the largest value (the lowest index among ties).
pub fn argmax(values: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in values.iter().enumerate() {
        if v > values[best] {
            best = i;
        }
    }
    best
}

/// The indices of the `k` largest values, largest first (ties by lower index).
pub fn top_k_indices(values: &[f32], k: usize) -> Vec<usize> {
    let k = k.min(values.len());
    if k == 0 {
        return Vec::new();
    }
    let cmp = |a: &usize, b: &usize| {
        values[*b]
            .partial_cmp(&values[*a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(b))
    };
    let mut idx: Vec<usize> = (0..values.len()).collect();
    if k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
    }
    idx.sort_by(cmp);
    idx
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_with_normalised_logprob() {
        let mut s = Sampler::new(SamplingParams::greedy(1), 0);
        let t = s.sample(&[0.0, 2.0, 1.0]);
        assert_eq!(t.id, 1);
        let z = (0f32.exp() + 2f32.exp() + 1f32.exp()).ln();
        assert!((t.logprob - (2.0 - z)).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_is_greedy_and_seed_is_reproducible() {
        let logits: Vec<f32> = (0..1000).map(|i| ((i * 37) % 101) as f32 / 10.0).collect();
        let params = SamplingParams {
            top_k: 1,
            seed: Some(3),
            ..Default::default()
        };
        let mut s = Sampler::new(params, 0);
        assert_eq!(s.sample(&logits).id as usize, argmax(&logits));

        let params = SamplingParams {
            top_p: 0.9,
            seed: Some(7),
            ..Default::default()
        };
        let draw = |i| {
            let mut s = Sampler::new(params.clone(), i);
            (0..20).map(|_| s.sample(&logits).id).collect::<Vec<_>>()
        };
        assert_eq!(draw(0), draw(0));
        assert_ne!(draw(0), draw(1));
    }

    #[test]
    fn top_p_keeps_only_the_nucleus() {
        // One token holds ~88% of the mass, the rest share the remainder.
        let mut logits = vec![0.0f32; 100];
        logits[42] = 7.0;
        let params = SamplingParams {
            top_p: 0.5,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(params, 0);
        for _ in 0..50 {
            assert_eq!(s.sample(&logits).id, 42);
        }
    }

    #[test]
    fn top_k_indices_sorted() {
        assert_eq!(top_k_indices(&[0.1, 0.5, 0.3, 0.5], 3), vec![1, 3, 2]);
    }
}
