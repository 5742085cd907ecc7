use art_core::{ImportanceSamplingLevel, KlPenaltySource, LossFn, TrainConfig};

#[test]
fn defaults_are_art_defaults_and_valid() {
    let config = TrainConfig::default();
    assert_eq!(config.learning_rate, 5e-6);
    assert_eq!(config.beta, 0.0);
    assert_eq!(config.epsilon_high(), 0.2);
    assert_eq!(
        config.importance_sampling_level,
        ImportanceSamplingLevel::Token
    );
    assert_eq!(config.lora.target_modules.len(), 7);
    config.validate().unwrap();
}

#[test]
fn partial_json_fills_in_defaults() {
    let config: TrainConfig = serde_json::from_str(
        r#"{"learning_rate": 1e-4, "epsilon_high": 0.28, "lora": {"rank": 16}}"#,
    )
    .unwrap();
    assert_eq!(config.learning_rate, 1e-4);
    assert_eq!(config.epsilon_high(), 0.28);
    assert_eq!(config.lora.rank, 16);
    assert_eq!(config.lora.alpha, 16.0);
    let sequence: TrainConfig =
        serde_json::from_str(r#"{"importance_sampling_level": "sequence"}"#).unwrap();
    assert_eq!(
        sequence.importance_sampling_level,
        ImportanceSamplingLevel::Sequence
    );
}

#[test]
fn bad_values_are_named_in_the_error() {
    let bad = TrainConfig {
        learning_rate: -1.0,
        ..Default::default()
    };
    let error = bad.validate().unwrap_err().to_string();
    assert!(error.contains("learning_rate = -1"), "{error}");
    let mut bad = TrainConfig::default();
    bad.lora.dropout = 1.5;
    assert!(bad
        .validate()
        .unwrap_err()
        .to_string()
        .contains("lora.dropout"));
    let nan = TrainConfig {
        max_grad_norm: Some(f64::NAN),
        ..Default::default()
    };
    assert!(nan.validate().is_err());
}

/// What openpipe-art 0.5.23's `ServerlessBackend.train(model, groups)` sends with no options
/// (read from its `_train_model`): every field, ART's defaults, nulls for the unset ones.
const ART_DEFAULT_EXPERIMENTAL_CONFIG: &str = r#"{
    "advantage_balance": 0.0, "allow_training_without_logprobs": false, "epsilon": null,
    "epsilon_high": null, "importance_sampling_level": "token", "kimi_k2_tau": null,
    "kl_penalty_coef": 0.0, "kl_penalty_reference_step": null,
    "kl_penalty_source": "current_learner", "kl_penalty_step_lag": null,
    "kl_ref_adapter_path": null, "learning_rate": 5e-06, "logprob_calculation_chunk_size": 1024,
    "loss_fn": "cispo", "mask_prob_ratio": false,
    "max_negative_advantage_importance_sampling_weight": null, "normalize_advantages": true,
    "num_trajectories_learning_rate_multiplier_power": 0.0, "packed_sequence_length": null,
    "plot_tensors": false, "ppo": false, "precalculate_logprobs": false,
    "scale_learning_rate_by_reward_std_dev": false, "scale_rewards": true,
    "truncated_importance_sampling": null
}"#;

fn experimental(patch: serde_json::Value) -> art_core::ExperimentalConfig {
    let mut config: serde_json::Value =
        serde_json::from_str(ART_DEFAULT_EXPERIMENTAL_CONFIG).unwrap();
    for (k, v) in patch.as_object().unwrap() {
        config[k] = v.clone();
    }
    serde_json::from_value(config).unwrap()
}

#[test]
fn python_arts_default_settings_map_to_cispo_with_its_epsilons() {
    let config = experimental(serde_json::json!({}))
        .train_config(&TrainConfig::default(), 7)
        .unwrap();
    assert_eq!(config.loss_fn, LossFn::Cispo);
    assert_eq!((config.epsilon, config.epsilon_high()), (1.0, 4.0));
    assert_eq!(config.learning_rate, 5e-6);
    assert!(config.scale_rewards);
    config.validate().unwrap();
    // PPO by either name, with ART's trust region; explicit epsilons win.
    for patch in [
        serde_json::json!({"loss_fn": "ppo", "ppo": true}),
        serde_json::json!({"loss_fn": null, "ppo": true}),
    ] {
        let ppo = experimental(patch)
            .train_config(&TrainConfig::default(), 7)
            .unwrap();
        assert_eq!(ppo.loss_fn, LossFn::Ppo);
        assert_eq!((ppo.epsilon, ppo.epsilon_high()), (0.2, 0.2));
    }
    let custom = experimental(serde_json::json!({
        "epsilon": 0.1, "epsilon_high": 0.3, "importance_sampling_level": "geometric_average",
        "scale_rewards": false, "normalize_advantages": false, "packed_sequence_length": 2048,
        "learning_rate": 1e-4
    }))
    .train_config(&TrainConfig::default(), 7)
    .unwrap();
    assert_eq!((custom.epsilon, custom.epsilon_high()), (0.1, 0.3));
    assert_eq!(
        custom.importance_sampling_level,
        ImportanceSamplingLevel::GeometricAverage
    );
    assert!(!custom.scale_rewards);
    assert_eq!(custom.micro_batch_tokens, 2048);
    assert_eq!(custom.packed_sequence_length, Some(2048));
    assert_eq!(custom.pack_sequences, Some(true));
    assert_eq!(custom.learning_rate, 1e-4);

    // ART's other loss options, with their names; a KL reference lag counts back from the
    // model's step (7 here).
    let art = experimental(serde_json::json!({
        "advantage_balance": 0.5, "kl_penalty_coef": 0.1, "kl_penalty_source": "sample",
        "kl_penalty_step_lag": 2, "mask_prob_ratio": true, "kimi_k2_tau": 0.1,
        "max_negative_advantage_importance_sampling_weight": 3.0,
        "precalculate_logprobs": true, "truncated_importance_sampling": 2.0
    }))
    .train_config(&TrainConfig::default(), 7)
    .unwrap();
    assert_eq!(art.advantage_balance, 0.5);
    assert_eq!(art.kl_penalty_coef, 0.1);
    assert_eq!(art.kl_penalty_source, KlPenaltySource::Sample);
    assert_eq!(art.kl_penalty_reference_step, Some(5));
    assert!(art.mask_prob_ratio && art.precalculate_logprobs);
    assert_eq!(art.kimi_k2_tau, Some(0.1));
    assert_eq!(
        art.max_negative_advantage_importance_sampling_weight,
        Some(3.0)
    );
    assert_eq!(art.truncated_importance_sampling, Some(2.0));
    art.validate().unwrap();
    // Truncated importance sampling weighs start-of-step logprobs against the sampler's.
    let error = TrainConfig {
        truncated_importance_sampling: Some(2.0),
        ..Default::default()
    }
    .validate()
    .unwrap_err();
    assert!(
        error.to_string().contains("precalculate_logprobs"),
        "{error}"
    );
}

#[test]
fn settings_this_server_does_not_implement_are_refused_by_name() {
    for (patch, field) in [
        (serde_json::json!({"plot_tensors": true}), "plot_tensors"),
        (
            serde_json::json!({"scale_learning_rate_by_reward_std_dev": true}),
            "scale_learning_rate_by_reward_std_dev",
        ),
        (
            serde_json::json!({"kl_ref_adapter_path": "/some/adapter"}),
            "kl_ref_adapter_path",
        ),
        (
            serde_json::json!({"kl_penalty_reference_step": 2, "kl_penalty_step_lag": 1}),
            "kl_penalty_step_lag",
        ),
        (
            serde_json::json!({"kl_penalty_source": "oracle"}),
            "kl_penalty_source",
        ),
        (
            serde_json::json!({"a_future_setting": 3}),
            "a_future_setting",
        ),
        // Contradictions between the old and new names of one setting.
        (serde_json::json!({"loss_fn": "cispo", "ppo": true}), "ppo"),
        (
            serde_json::json!({"scale_rewards": true, "normalize_advantages": false}),
            "normalize_advantages",
        ),
    ] {
        let error = experimental(patch.clone())
            .train_config(&TrainConfig::default(), 7)
            .unwrap_err();
        assert_eq!(error.field, field, "{patch}");
        assert!(error.to_string().contains(field), "{error}");
    }
    // Null is the default, also for fields this server does not know.
    experimental(serde_json::json!({"a_future_setting": null, "plot_tensors": null}))
        .train_config(&TrainConfig::default(), 7)
        .unwrap();
}
