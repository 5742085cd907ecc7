//! Writes a random-weight model as a Hugging Face directory.
//!
//! cargo run -p art-core --features engine --example write_random_model -- ARCH SIZE SEED OUT_DIR
//!   ARCH: llama | qwen2 | qwen3
//!   SIZE: tiny (2 layers, hidden 64) | qwen2.5-0.5b | qwen2.5-1.5b (real shapes)
use art_core::engine::random::RandomModelSpec;
use art_core::engine::Architecture;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [arch, size, seed, out] = args.as_slice() else {
        eprintln!("usage: write_random_model ARCH SIZE SEED OUT_DIR");
        std::process::exit(2);
    };
    let arch = Architecture::parse(arch).unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(2)
    });
    let mut spec = RandomModelSpec::tiny(arch);
    match size.as_str() {
        "tiny" => {}
        "qwen2.5-0.5b" => {
            spec = RandomModelSpec {
                vocab_size: 151_936,
                hidden_size: 896,
                intermediate_size: 4864,
                num_hidden_layers: 24,
                num_attention_heads: 14,
                num_key_value_heads: 2,
                head_dim: 64,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 32_768,
                tie_word_embeddings: true,
                ..spec
            }
        }
        "qwen2.5-1.5b" => {
            spec = RandomModelSpec {
                vocab_size: 151_936,
                hidden_size: 1536,
                intermediate_size: 8960,
                num_hidden_layers: 28,
                num_attention_heads: 12,
                num_key_value_heads: 2,
                head_dim: 128,
                rope_theta: 1_000_000.0,
                max_position_embeddings: 32_768,
                tie_word_embeddings: true,
                ..spec
            }
        }
        other => {
            eprintln!("unknown size `{other}`: use tiny, qwen2.5-0.5b or qwen2.5-1.5b");
            std::process::exit(2)
        }
    }
    let seed: u64 = seed.parse().expect("SEED is a number");
    spec.write(std::path::Path::new(out), seed)
        .unwrap_or_else(|e| panic!("{e}"));
    println!("wrote {out}");
}
