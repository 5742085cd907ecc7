//! The fused kernels against candle's composite ops and finite differences.
use super::*;
use candle_core::{Device, Var, D};

fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 10_000) as f64 / 2_500.0 - 2.0
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

#[test]
fn fast_exp_is_within_a_few_ulp() {
    let mut worst = 0f64;
    let mut x = -87.0f32;
    while x < 88.0 {
        let want = f64::from(x).exp();
        let got = f64::from(exp_f32(x));
        worst = worst.max(((got - want) / want).abs());
        x += 0.001_3;
    }
    assert!(
        worst < 4.0 * f64::from(f32::EPSILON),
        "worst relative error {worst}"
    );
    assert_eq!(exp_f32(0.0), 1.0);
    assert!(exp_f32(f32::NEG_INFINITY) < 1e-37);
}

/// Forward against candle's composite ops, backward against candle's autograd of them, for
/// a scalar loss `sum(out * w)` with random `w`.
fn check(
    fused: impl Fn(&Tensor) -> Tensor,
    reference: impl Fn(&Tensor) -> Tensor,
    shape: &[usize],
    tol: f64,
) {
    for dtype in [DType::F64, DType::F32] {
        let x = Var::from_tensor(&randn(shape, 1, dtype)).unwrap();
        let (a, b) = (fused(x.as_tensor()), reference(x.as_tensor()));
        assert!(
            max_diff(&a, &b) < tol,
            "{dtype:?} forward: {}",
            max_diff(&a, &b)
        );
        let w = randn(a.dims(), 2, dtype);
        let ga = (a * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let gb = (b * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let (ga, gb) = (ga.get(&x).unwrap(), gb.get(&x).unwrap());
        assert!(
            max_diff(ga, gb) < tol,
            "{dtype:?} backward: {}",
            max_diff(ga, gb)
        );
    }
}

#[test]
fn rms_norm_matches_the_composite_ops() {
    let w = randn(&[24], 3, DType::F64);
    check(
        |x| rms_norm(x, &w, 1e-5).unwrap(),
        |x| candle_nn::ops::rms_norm_slow(x, &w.to_dtype(x.dtype()).unwrap(), 1e-5).unwrap(),
        &[3, 5, 24],
        1e-5,
    );
}

#[test]
fn rope_matches_the_composite_ops() {
    let (b, h, l, hd) = (2, 3, 5, 8);
    let cos = randn(&[b, l, hd / 2], 4, DType::F64);
    let sin = randn(&[b, l, hd / 2], 5, DType::F64);
    check(
        |x| rope(x, &cos, &sin).unwrap(),
        |x| {
            let cos = Tensor::cat(&[&cos, &cos], D::Minus1)
                .unwrap()
                .unsqueeze(1)
                .unwrap();
            let sin = Tensor::cat(&[&sin, &sin], D::Minus1)
                .unwrap()
                .unsqueeze(1)
                .unwrap();
            let (cos, sin) = (
                cos.to_dtype(x.dtype()).unwrap(),
                sin.to_dtype(x.dtype()).unwrap(),
            );
            let x1 = x.narrow(D::Minus1, 0, hd / 2).unwrap();
            let x2 = x.narrow(D::Minus1, hd / 2, hd / 2).unwrap();
            let rotated = Tensor::cat(&[&x2.neg().unwrap(), &x1], D::Minus1).unwrap();
            (x.broadcast_mul(&cos).unwrap() + rotated.broadcast_mul(&sin).unwrap()).unwrap()
        },
        &[b, h, l, hd],
        1e-5,
    );
}

#[test]
fn causal_softmax_matches_masked_softmax() {
    // 2 heads' queries stacked per row block, 3 queries at offset 2, 5 keys.
    let (rep, l, offset) = (2, 3, 2);
    let t = offset + l;
    let mask: Vec<f64> = (0..rep * l)
        .flat_map(|r| {
            (0..t).map(move |k| {
                if k <= offset + r % l {
                    0.0
                } else {
                    f64::NEG_INFINITY
                }
            })
        })
        .collect();
    let mask = Tensor::from_vec(mask, (rep * l, t), &Device::Cpu).unwrap();
    check(
        |x| causal_softmax(x, l, offset).unwrap(),
        |x| {
            let m = mask.to_dtype(x.dtype()).unwrap();
            candle_nn::ops::softmax(&x.broadcast_add(&m).unwrap(), D::Minus1).unwrap()
        },
        &[2, 2, rep * l, t],
        1e-5,
    );
}

#[test]
fn add_repeats_a_bias_over_rows() {
    let x = randn(&[3, 4], 1, DType::F32);
    let bias = randn(&[4], 2, DType::F32);
    for b in [bias, randn(&[3, 4], 3, DType::F32)] {
        let ours = x.apply_op2_no_bwd(&b, &super::add::Add).unwrap();
        let reference = x.broadcast_add(&b).unwrap();
        let diff = (ours - reference)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert_eq!(diff, 0.0);
    }
}

#[test]
fn transpose12_swaps_heads_and_positions() {
    for dtype in [DType::F32, DType::F64] {
        let x = randn(&[2, 3, 4, 5], 7, dtype);
        let ours = transpose12(&x).unwrap();
        let reference = x.transpose(1, 2).unwrap().contiguous().unwrap();
        assert_eq!(ours.dims(), reference.dims());
        let diff = (ours - reference)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert_eq!(diff, 0.0);
    }
    let err = transpose12(&randn(&[3, 4, 5], 8, DType::F32)).unwrap_err();
    assert!(err.to_string().contains("is not 4-D"), "{err}");
}

#[test]
fn target_logprob_and_entropy_match_log_softmax() {
    let targets = [3u32, 0, 6, 2];
    let idx = Tensor::new(&targets, &Device::Cpu)
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    check(
        |x| target_logprob_entropy(x, &targets).unwrap(),
        |x| {
            let lsm = candle_nn::ops::log_softmax(x, D::Minus1).unwrap();
            let lp = lsm.gather(&idx, 1).unwrap();
            let ent = (lsm.exp().unwrap() * &lsm)
                .unwrap()
                .sum_keepdim(1)
                .unwrap()
                .neg()
                .unwrap();
            Tensor::cat(&[lp, ent], 1).unwrap()
        },
        &[4, 7],
        1e-5,
    );
}

#[test]
fn silu_mul_and_its_backward_match_autograd() {
    for dtype in [DType::F64, DType::F32] {
        let gate = Var::from_tensor(&randn(&[3, 40], 5, dtype)).unwrap();
        let up = Var::from_tensor(&randn(&[3, 40], 6, dtype)).unwrap();
        let grad = randn(&[3, 40], 7, dtype);
        let composite = (gate.as_tensor().silu().unwrap() * up.as_tensor()).unwrap();
        let fused = silu_mul(gate.as_tensor(), up.as_tensor()).unwrap();
        assert!(max_diff(&fused, &composite) < 1e-5);
        let grads = (composite * &grad)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let (d_gate, d_up) = silu_mul_grad(gate.as_tensor(), up.as_tensor(), &grad).unwrap();
        assert!(max_diff(&d_gate, grads.get(gate.as_tensor()).unwrap()) < 1e-5);
        assert!(max_diff(&d_up, grads.get(up.as_tensor()).unwrap()) < 1e-5);
    }
}
