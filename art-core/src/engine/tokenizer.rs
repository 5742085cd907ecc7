//! Tokenizers: read from a Hugging Face `tokenizer.json`, or rebuilt from GGUF metadata
//! (gpt2-style byte-level BPE with merges), plus the facts around them that generation needs
//! (end-of-sequence ids, the chat template, bos/eos strings).

use std::path::Path;

use candle_core::quantized::gguf_file;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::unicode::NFC;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

use super::error::{EngineError, Result};

/// What generation needs to know about a tokenizer besides the tokenizer itself.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TokenizerInfo {
    /// Ids that end a generation (the eos token, and e.g. `<|im_end|>` / `<|endoftext|>`).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    /// The Jinja chat template shipped with the model, if any.
    pub chat_template: Option<String>,
}

impl TokenizerInfo {
    fn add_eos(&mut self, id: u32) {
        if !self.eos_token_ids.contains(&id) {
            self.eos_token_ids.push(id);
        }
    }
}

fn tok_err(what: impl std::fmt::Display) -> EngineError {
    EngineError::Tokenizer(what.to_string())
}

// Pre-tokenizer regexes, as llama.cpp and the Hugging Face tokenizer.json files define them.
const REGEX_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const REGEX_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn split(regex: &str) -> Result<PreTokenizerWrapper> {
    Ok(Split::new(
        SplitPattern::Regex(regex.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tok_err)?
    .into())
}

/// Rebuilds the tokenizer a GGUF file describes (`tokenizer.ggml.*`). Only the gpt2 (byte-level
/// BPE) model is supported, which covers the llama-3, SmolLM and Qwen families.
pub fn from_gguf(path: &Path, content: &gguf_file::Content) -> Result<(Tokenizer, TokenizerInfo)> {
    let md = &content.metadata;
    let get = |key: &str| md.get(key);
    let need = |key: &str| {
        get(key).ok_or_else(|| {
            tok_err(format!(
                "{}: GGUF metadata lacks `{key}`; the file has no usable tokenizer",
                path.display()
            ))
        })
    };
    let model = need("tokenizer.ggml.model")?.to_string()?;
    if model != "gpt2" {
        return Err(tok_err(format!(
            "{}: tokenizer model `{model}` is not supported (only gpt2-style byte-level BPE); \
             load the model from a Hugging Face directory with a tokenizer.json instead",
            path.display()
        )));
    }
    let strings = |key: &str| -> Result<Vec<String>> {
        need(key)?
            .to_vec()?
            .iter()
            .map(|v| Ok(v.to_string()?.clone()))
            .collect()
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges: Vec<(String, String)> = strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| tok_err(format!("malformed merge `{m}` in GGUF metadata")))
        })
        .collect::<Result<_>>()?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect();
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tok_err)?;
    let mut tokenizer = Tokenizer::new(bpe);

    let pre = get("tokenizer.ggml.pre")
        .and_then(|v| v.to_string().ok())
        .map(String::as_str)
        .unwrap_or("gpt2");
    // ByteLevel(add_prefix_space, trim_offsets, use_regex)
    match pre {
        "qwen2" => {
            tokenizer.with_normalizer(Some(NFC)).map_err(tok_err)?;
            tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
                split(REGEX_QWEN2)?,
                ByteLevel::new(false, false, false).into(),
            ])));
        }
        "llama3" | "llama-bpe" | "smaug-bpe" => {
            tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
                split(REGEX_LLAMA3)?,
                ByteLevel::new(false, true, false).into(),
            ])));
        }
        // SmolLM: digits one by one, then GPT-2's regex (its tokenizer.json says exactly this).
        "smollm" => {
            tokenizer.with_pre_tokenizer(Some(Sequence::new(vec![
                Digits::new(true).into(),
                ByteLevel::new(false, true, true).into(),
            ])));
        }
        _ => {
            tokenizer.with_pre_tokenizer(Some(ByteLevel::new(false, true, true)));
        }
    }
    tokenizer.with_decoder(Some(ByteLevelDecoder::new(false, true, true)));

    // Control tokens (type 3) become special tokens, user-defined ones (type 4, e.g. Qwen's
    // <tool_call>) plain added tokens: both then encode as one id, and only the special ones are
    // dropped by decode(skip_special_tokens = true).
    if let Some(types) = get("tokenizer.ggml.token_type") {
        let mut special = Vec::new();
        let mut added = Vec::new();
        for (i, v) in types.to_vec()?.iter().enumerate() {
            let ty = match v {
                gguf_file::Value::I32(x) => *x as i64,
                gguf_file::Value::U32(x) => *x as i64,
                other => other.to_i32().map(i64::from).unwrap_or(1),
            };
            match ty {
                3 => special.push(AddedToken::from(tokens[i].clone(), true)),
                4 => added.push(AddedToken::from(tokens[i].clone(), false)),
                _ => {}
            }
        }
        tokenizer.add_special_tokens(special).map_err(tok_err)?;
        tokenizer.add_tokens(added).map_err(tok_err)?;
    }

    let id = |key: &str| -> Option<u32> { get(key).and_then(|v| v.to_u32().ok()) };
    let mut info = TokenizerInfo::default();
    if let Some(eos) = id("tokenizer.ggml.eos_token_id") {
        info.add_eos(eos);
        info.eos_token = tokens.get(eos as usize).cloned();
    }
    if let Some(eot) = id("tokenizer.ggml.eot_token_id") {
        info.add_eos(eot);
    }
    info.bos_token_id = id("tokenizer.ggml.bos_token_id");
    info.bos_token = info
        .bos_token_id
        .and_then(|b| tokens.get(b as usize).cloned());
    info.chat_template = get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .cloned();
    add_chat_end_tokens(&tokenizer, &mut info);
    Ok((tokenizer, info))
}

/// Chat models end a turn with `<|im_end|>` (ChatML) or `<|eot_id|>` (llama-3) even when their
/// declared eos is another token; generation should stop on those too.
fn add_chat_end_tokens(tokenizer: &Tokenizer, info: &mut TokenizerInfo) {
    let template = info.chat_template.clone().unwrap_or_default();
    for marker in ["<|im_end|>", "<|eot_id|>", "<|end|>"] {
        if template.contains(marker) {
            if let Some(id) = tokenizer.token_to_id(marker) {
                info.add_eos(id);
            }
        }
    }
}

/// Reads `tokenizer.json`, and from `tokenizer_config.json`, `generation_config.json` and
/// `config.json` the chat template and the end-of-sequence ids.
pub fn from_hf_dir(dir: &Path) -> Result<(Tokenizer, TokenizerInfo)> {
    let path = dir.join("tokenizer.json");
    if !path.exists() {
        return Err(EngineError::NotFound {
            path,
            hint: "a model directory needs tokenizer.json (GGUF files carry their own)".into(),
        });
    }
    let tokenizer =
        Tokenizer::from_file(&path).map_err(|e| tok_err(format!("{}: {e}", path.display())))?;
    let mut info = TokenizerInfo::default();
    let read_json = |name: &str| -> Result<Option<serde_json::Value>> {
        let p = dir.join(name);
        if !p.exists() {
            return Ok(None);
        }
        let text = std::fs::read_to_string(&p).map_err(|e| EngineError::io(&p, e))?;
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| tok_err(format!("{}: {e}", p.display())))
    };
    // A token given as "text" or {"content": "text", ...}.
    fn token_text(v: &serde_json::Value) -> Option<String> {
        v.as_str()
            .map(String::from)
            .or_else(|| v.get("content")?.as_str().map(String::from))
    }
    if let Some(tc) = read_json("tokenizer_config.json")? {
        info.chat_template = match tc.get("chat_template") {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default", else the first.
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template")?.as_str().map(String::from)),
            _ => None,
        };
        info.eos_token = tc.get("eos_token").and_then(token_text);
        info.bos_token = tc.get("bos_token").and_then(token_text);
    }
    // A separate chat_template.jinja (newer transformers) wins when present.
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        info.chat_template =
            Some(std::fs::read_to_string(&jinja).map_err(|e| EngineError::io(&jinja, e))?);
    }
    if let Some(id) = info
        .eos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t))
    {
        info.add_eos(id);
    }
    info.bos_token_id = info
        .bos_token
        .as_deref()
        .and_then(|t| tokenizer.token_to_id(t));
    for name in ["generation_config.json", "config.json"] {
        if let Some(v) = read_json(name)? {
            match v.get("eos_token_id") {
                Some(serde_json::Value::Number(n)) => {
                    if let Some(id) = n.as_u64() {
                        info.add_eos(id as u32)
                    }
                }
                Some(serde_json::Value::Array(ids)) => {
                    for id in ids.iter().filter_map(|i| i.as_u64()) {
                        info.add_eos(id as u32)
                    }
                }
                _ => {}
            }
        }
    }
    add_chat_end_tokens(&tokenizer, &mut info);
    Ok((tokenizer, info))
}
