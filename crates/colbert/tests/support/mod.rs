//! Tiny checkpoints generated for the tests (random weights, a real
//! WordPiece tokenizer.json written by the `tokenizers` crate) in the
//! PyLate, colbert-ai and plain-encoder layouts.
#![allow(dead_code)]

use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::bert;
use std::path::{Path, PathBuf};
use tokenizers::models::wordpiece::WordPiece;
use tokenizers::normalizers::bert::BertNormalizer;
use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, Tokenizer};

pub const VOCAB: &[&str] = &[
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
    "[unused0]",
    "[unused1]",
    "[Q]",
    "[D]",
    ".",
    ",",
    "!",
    "?",
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "dog",
    "runs",
    "fast",
    "a",
    "red",
    "ball",
    "is",
    "big",
    "small",
    "##s",
];
pub const HIDDEN: usize = 32;
pub const DOUT: usize = 8;

pub fn id(t: &str) -> u32 {
    VOCAB.iter().position(|v| *v == t).unwrap() as u32
}

pub fn write_tokenizer(dir: &Path, markers: &[&str]) -> anyhow::Result<()> {
    // vocab.txt (one token per line, the id is the line number) read by the crate's WordPiece builder.
    let vocab_txt = dir.join("vocab.txt");
    std::fs::write(&vocab_txt, VOCAB.join("\n") + "\n")?;
    let wp = WordPiece::builder()
        .files(vocab_txt.to_string_lossy().into_owned())
        .unk_token("[UNK]".into())
        .build()
        .map_err(anyhow::Error::msg)?;
    let mut tok = Tokenizer::new(wp);
    tok.with_normalizer(Some(BertNormalizer::default())).map_err(anyhow::Error::msg)?;
    tok.with_pre_tokenizer(Some(BertPreTokenizer));
    let tp = TemplateProcessing::builder()
        .try_single("[CLS] $A [SEP]")
        .map_err(anyhow::Error::msg)?
        .special_tokens(vec![("[CLS]", id("[CLS]")), ("[SEP]", id("[SEP]"))])
        .build()?;
    tok.with_post_processor(Some(tp));
    let mut special: Vec<AddedToken> =
        ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"].iter().map(|t| AddedToken::from(*t, true)).collect();
    special.extend(markers.iter().map(|t| AddedToken::from(*t, true)));
    tok.add_special_tokens(special).map_err(anyhow::Error::msg)?;
    tok.save(dir.join("tokenizer.json"), false).map_err(anyhow::Error::msg)?;
    Ok(())
}

pub fn bert_config() -> serde_json::Value {
    serde_json::json!({
        "vocab_size": VOCAB.len(), "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 64, "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "max_position_embeddings": 64,
        "type_vocab_size": 2, "initializer_range": 0.02, "layer_norm_eps": 1e-12, "pad_token_id": 0,
        "classifier_dropout": null, "model_type": "bert"
    })
}

pub use candle_maxsim_testing::tmpdir;

/// A random tiny BERT encoder in `dir`: config.json and model.safetensors.
fn random_bert(dir: &Path) -> anyhow::Result<()> {
    random_bert_with(dir, bert_config())
}

fn random_bert_with(dir: &Path, config: serde_json::Value) -> anyhow::Result<()> {
    std::fs::write(dir.join("config.json"), config.to_string())?;
    let vm = VarMap::new();
    bert::BertModel::load(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &serde_json::from_value(config)?)?;
    vm.save(dir.join("model.safetensors"))?;
    Ok(())
}

/// PyLate / Sentence Transformers layout: encoder, 1_Dense, ST config.
pub fn pylate_checkpoint() -> anyhow::Result<PathBuf> {
    let dir = tmpdir("pylate");
    random_bert(&dir)?;
    std::fs::create_dir_all(dir.join("1_Dense"))?;
    let dense = VarMap::new();
    VarBuilder::from_varmap(&dense, DType::F32, &Device::Cpu).get_with_hints(
        (DOUT, HIDDEN),
        "linear.weight",
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
    )?;
    dense.save(dir.join("1_Dense/model.safetensors"))?;
    std::fs::write(
        dir.join("1_Dense/config.json"),
        serde_json::json!({"in_features": HIDDEN, "out_features": DOUT, "bias": false}).to_string(),
    )?;
    std::fs::write(
        dir.join("config_sentence_transformers.json"),
        serde_json::json!({
            "query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 12, "document_length": 10,
            "attend_to_expansion_tokens": false, "do_query_expansion": true,
            "skiplist_words": [".", ",", "!", "?"]
        })
        .to_string(),
    )?;
    std::fs::write(dir.join("special_tokens_map.json"), r#"{"mask_token": "[MASK]", "pad_token": "[PAD]"}"#)?;
    write_tokenizer(&dir, &["[Q]", "[D]"])?;
    Ok(dir)
}

/// colbert-ai layout: `bert.*` and `linear.weight` in one file, artifact.metadata.
pub fn colbert_ai_checkpoint() -> anyhow::Result<PathBuf> {
    let dir = tmpdir("colbertai");
    std::fs::write(dir.join("config.json"), bert_config().to_string())?;
    let vm = VarMap::new();
    let vb = VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu);
    bert::BertModel::load(vb.pp("bert"), &serde_json::from_value(bert_config())?)?;
    vb.get_with_hints((DOUT, HIDDEN), "linear.weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
    vm.save(dir.join("model.safetensors"))?;
    std::fs::write(dir.join("artifact.metadata"), r#"{"query_maxlen": 8, "doc_maxlen": 9}"#)?;
    write_tokenizer(&dir, &[])?;
    Ok(dir)
}

/// A plain BERT encoder: no projection, no markers in the tokenizer (as
/// all-MiniLM-L6-v2).
pub fn plain_checkpoint() -> anyhow::Result<PathBuf> {
    let dir = tmpdir("plain");
    random_bert(&dir)?;
    write_tokenizer(&dir, &[])?;
    Ok(dir)
}

/// [`plain_checkpoint`] with 32-wide heads (64 wide, 2 heads), a head dim
/// the fused attention kernels are built for.
pub fn plain_checkpoint_wide_heads() -> anyhow::Result<PathBuf> {
    let dir = tmpdir("plain-wide");
    let mut c = bert_config();
    c["hidden_size"] = 64.into();
    c["num_attention_heads"] = 2.into();
    c["intermediate_size"] = 128.into();
    random_bert_with(&dir, c)?;
    write_tokenizer(&dir, &[])?;
    Ok(dir)
}
