use art_core::{ImportanceSamplingLevel, TrainConfig};

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
