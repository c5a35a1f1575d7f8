//! The colbert example run in-process, on tiny checkpoints (tests/support)
//! and temporary files: its argument checks and its `--index` record.

mod support;

#[allow(dead_code)]
#[path = "../examples/colbert.rs"]
mod colbert_example;

use candle_core::{Device, Tensor};
use candle_maxsim_plaid::{DocumentsWriter, IndexConfig};
use clap::{CommandFactory, Parser};
use colbert_example::{cli, index};
use index::{BuiltFrom, RECORD};
use std::path::{Path, PathBuf};
use support::*;

/// The error's message with its causes, as `Error: ...` would print it.
fn message<T>(r: anyhow::Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

fn write_docs(dir: &Path, name: &str, docs: &[&str]) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, docs.join("\n") + "\n").unwrap();
    p
}

fn colbert(args: &[&str]) -> anyhow::Result<()> {
    let args = colbert_example::Args::try_parse_from(std::iter::once("colbert").chain(args.iter().copied()))?;
    colbert_example::run(&args)
}

const DOCS_A: &[&str] = &["the cat sat on the mat", "a dog runs fast", "the red ball is big", "a small cat"];
const DOCS_B: &[&str] = &["the dog sat", "a red mat", "the ball runs", "big small dog"];

#[test]
fn sha256_matches_known_digests() {
    let a_million = vec![b'a'; 1_000_000];
    for (data, want) in [
        (&b""[..], "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"),
        (b"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"),
        (
            b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1",
        ),
        (&a_million, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"),
    ] {
        assert_eq!(index::sha256_hex(data), want, "{} bytes", data.len());
    }
}

/// `--index` that is a file, or a directory of other files, is refused
/// naming the flag; an absent or empty directory is where one is built.
#[test]
fn index_dir_must_be_an_index_or_empty() -> anyhow::Result<()> {
    let dir = tmpdir("index-dir");
    assert!(!index::holds_index(&dir.join("new"))?);
    assert!(!index::holds_index(&dir)?, "an empty directory");
    let file = write_docs(&dir, "docs.txt", DOCS_A);
    let e = message(index::holds_index(&file));
    assert!(e.contains(&format!("--index {}", file.display())) && e.contains("is a file"), "{e}");
    let e = message(index::holds_index(&dir));
    assert!(e.contains("--index") && e.contains("not an index"), "{e}");
    Ok(())
}

/// Unit-norm random embeddings of `n` documents of 3..6 tokens.
fn embeddings(n: usize, dim: usize, seed: u64) -> anyhow::Result<(Tensor, Vec<u32>)> {
    let lens: Vec<u32> = (0..n as u32).map(|i| 3 + (i + seed as u32) % 4).collect();
    let t = lens.iter().sum::<u32>() as usize;
    let x = Tensor::randn(0f32, 1f32, (t, dim), &Device::Cpu)?;
    Ok((candle_maxsim::l2_normalize(&x)?, lens))
}

fn want(docs_file: &Path, docs: &[&str], model: &Path, dim: usize) -> BuiltFrom {
    let docs: Vec<String> = docs.iter().map(|d| d.to_string()).collect();
    BuiltFrom::new(docs_file, &docs, model, dim)
}

/// The record is written once the index is complete; an index is opened
/// only for the documents and model it records, refused otherwise with a
/// message naming the difference and `--rebuild`, which rebuilds it.
#[test]
fn index_record_decides_open_build_refuse() -> anyhow::Result<()> {
    let tmp = tmpdir("index-record");
    let (dir, model, other_model) = (tmp.join("idx"), tmpdir("model-a"), tmpdir("model-b"));
    let (a, b) = (write_docs(&tmp, "a.txt", DOCS_A), write_docs(&tmp, "b.txt", DOCS_B));
    let cfg = IndexConfig::default();
    let dev = Device::Cpu;
    let want_a = want(&a, DOCS_A, &model, 8);
    let build = |w: &mut DocumentsWriter| {
        let (x, lens) = embeddings(DOCS_A.len(), 8, 0)?;
        Ok(w.push(&x, &lens)?)
    };
    let no_build = |_: &mut DocumentsWriter| -> anyhow::Result<()> { panic!("the index should have been opened") };

    let (idx, built) = index::open_or_build(&dir, &want_a, false, &cfg, &dev, build)?;
    assert!(built && idx.num_documents() == DOCS_A.len());
    assert_eq!(index::read_record(&dir)?.as_ref(), Some(&want_a));
    let leftovers: Vec<_> = std::fs::read_dir(&dir)?
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    let (_, built) = index::open_or_build(&dir, &want_a, false, &cfg, &dev, no_build)?;
    assert!(!built, "same documents and model: opened");

    // Other documents of the same count, another model, another dim: refused.
    let e = message(index::open_or_build(&dir, &want(&b, DOCS_B, &model, 8), false, &cfg, &dev, no_build));
    assert!(e.contains("other documents") && e.contains("--rebuild") && e.contains("--index"), "{e}");
    std::fs::write(&a, "the cat sat on the mat\na dog runs FAST\nthe red ball is big\na small cat\n")?;
    let edited = ["the cat sat on the mat", "a dog runs FAST", "the red ball is big", "a small cat"];
    let e = message(index::open_or_build(&dir, &want(&a, &edited, &model, 8), false, &cfg, &dev, no_build));
    assert!(e.contains("other documents"), "the same file, edited: {e}");
    let e = message(index::open_or_build(&dir, &want(&a, DOCS_A, &other_model, 8), false, &cfg, &dev, no_build));
    assert!(e.contains("model") && e.contains(&other_model.display().to_string()) && e.contains("--rebuild"), "{e}");
    let e = message(index::open_or_build(&dir, &want(&a, DOCS_A, &model, 16), false, &cfg, &dev, no_build));
    assert!(e.contains("model dim 16 vs index dim 8"), "{e}");
    assert_eq!(index::read_record(&dir)?.as_ref(), Some(&want_a), "a refusal changes nothing");

    // --rebuild: rebuilt and recorded.
    let want_b = want(&b, DOCS_B, &model, 16);
    let (idx, built) = index::open_or_build(&dir, &want_b, true, &cfg, &dev, |w| {
        let (x, lens) = embeddings(DOCS_B.len(), 16, 1)?;
        Ok(w.push(&x, &lens)?)
    })?;
    assert!(built && idx.dim() == 16);
    assert_eq!(index::read_record(&dir)?.as_ref(), Some(&want_b));

    // An index without a record (an interrupted build, another program's) is refused.
    std::fs::remove_file(dir.join(RECORD))?;
    let e = message(index::open_or_build(&dir, &want_b, false, &cfg, &dev, no_build));
    assert!(e.contains(RECORD) && e.contains("--rebuild"), "{e}");
    std::fs::write(dir.join(RECORD), "{}")?;
    let e = message(index::open_or_build(&dir, &want_b, false, &cfg, &dev, no_build));
    assert!(e.contains(RECORD) && e.contains("--rebuild"), "an invalid record: {e}");
    // A record that matches but an index of another dim (files replaced by hand).
    index::write_record(&dir, &BuiltFrom { dim: 8, ..want_b.clone() })?;
    let e = message(index::open_or_build(&dir, &BuiltFrom { dim: 8, ..want_b }, false, &cfg, &dev, no_build));
    assert!(e.contains("model dim 8 vs index dim 16"), "{e}");
    Ok(())
}

/// The colbert example end to end on a tiny checkpoint: an index built from
/// one documents file is not used for another of the same length, nor with a
/// model of another dim; `--rebuild` rebuilds it.
#[test]
fn colbert_index_follows_docs_and_model() -> anyhow::Result<()> {
    let tmp = tmpdir("colbert-index");
    let (model, plain) = (pylate_checkpoint()?, plain_checkpoint()?);
    let (model, plain) = (model.to_str().unwrap(), plain.to_str().unwrap());
    let (a, b) = (write_docs(&tmp, "a.txt", DOCS_A), write_docs(&tmp, "b.txt", DOCS_B));
    let (a, b) = (a.to_str().unwrap(), b.to_str().unwrap());
    let dir = tmp.join("idx");
    let dir = dir.to_str().unwrap();
    let q = ["--query", "the cat"];
    colbert(&[&q[..], &["--docs", a, "--model-dir", model, "--index", dir]].concat())?;
    assert!(Path::new(dir).join(RECORD).is_file());
    colbert(&[&q[..], &["--docs", a, "--model-dir", model, "--index", dir]].concat())?;
    let e = message(colbert(&[&q[..], &["--docs", b, "--model-dir", model, "--index", dir]].concat()));
    assert!(e.contains("other documents") && e.contains("--rebuild"), "{e}");
    colbert(&[&q[..], &["--docs", b, "--model-dir", model, "--index", dir, "--rebuild"]].concat())?;
    colbert(&[&q[..], &["--docs", b, "--model-dir", model, "--index", dir]].concat())?;
    let e = message(colbert(&[&q[..], &["--docs", b, "--model-dir", plain, "--index", dir]].concat()));
    assert!(e.contains(&format!("model dim {HIDDEN} vs index dim {DOUT}")), "{e}");
    // Exact scoring is unchanged by all this.
    colbert(&[&q[..], &["--docs", b, "--model-dir", model]].concat())?;
    Ok(())
}

/// Arguments are checked before the model is loaded: a blank query, a
/// `--rebuild` without `--index`, a documents file without documents, an
/// `--index` that is a file.
#[test]
fn colbert_rejects_bad_arguments() -> anyhow::Result<()> {
    let tmp = tmpdir("colbert-args");
    let docs = write_docs(&tmp, "docs.txt", DOCS_A);
    let docs = docs.to_str().unwrap();
    let no_model = tmp.join("no-model");
    let no_model = no_model.to_str().unwrap();
    for q in ["", "   ", " \t "] {
        let e = message(colbert(&["--query", q, "--docs", docs, "--model-dir", no_model]));
        assert!(e.contains("--query") && e.contains("blank"), "{q:?}: {e}");
    }
    let e = message(colbert(&["--query", "cat", "--docs", docs, "--rebuild"]));
    assert!(e.contains("--index"), "{e}");
    for (name, text) in [("empty.txt", ""), ("blank.txt", "\n  \n\t\n")] {
        let path = tmp.join(name);
        std::fs::write(&path, text)?;
        let path = path.to_str().unwrap();
        let idx = tmp.join("idx");
        for extra in [&[][..], &["--index", idx.to_str().unwrap()]] {
            let e = message(colbert(&[&["--query", "cat", "--docs", path, "--model-dir", no_model], extra].concat()));
            assert!(e.contains("--docs") && e.contains(path) && e.contains("no documents"), "{e}");
        }
        assert!(!idx.exists(), "no index is started without documents");
    }
    let e = message(colbert(&["--query", "cat", "--docs", docs, "--model-dir", no_model, "--index", docs]));
    assert!(e.contains(&format!("--index {docs}")) && e.contains("is a file"), "{e}");
    Ok(())
}

/// A model directory without tokenizer.json: the error names the path.
#[test]
fn colbert_missing_tokenizer_names_the_path() -> anyhow::Result<()> {
    let tmp = tmpdir("colbert-tokenizer");
    let docs = write_docs(&tmp, "docs.txt", DOCS_A);
    let model = pylate_checkpoint()?;
    std::fs::remove_file(model.join("tokenizer.json"))?;
    let e =
        message(colbert(&["--query", "cat", "--docs", docs.to_str().unwrap(), "--model-dir", model.to_str().unwrap()]));
    assert!(
        e.contains("--model-dir") && e.contains(&model.display().to_string()) && e.contains("tokenizer.json"),
        "{e}"
    );
    Ok(())
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_flag_without_the_feature_says_how_to_build() {
    let e = message(cli::device(true));
    assert!(e.contains("--cuda") && e.contains("--features cuda"), "{e}");
}

/// A child process's prints are captured: returned when it fails, never on our stdout.
#[test]
fn child_output_is_captured() {
    let mut ok = std::process::Command::new("sh");
    ok.args(["-c", "echo model package loaded"]);
    assert_eq!(cli::run_captured(&mut ok), Ok(()));
    let mut failing = std::process::Command::new("sh");
    failing.args(["-c", "echo to stdout; echo to stderr >&2; exit 3"]);
    let e = cli::run_captured(&mut failing).unwrap_err();
    assert!(e.contains("to stdout") && e.contains("to stderr") && e.contains('3'), "{e}");
    let e = cli::run_captured(&mut std::process::Command::new("/nonexistent/python3")).unwrap_err();
    assert!(e.contains("/nonexistent/python3"), "{e}");
}

/// Every flag has a help line.
#[test]
fn every_flag_has_help() {
    let cmd = colbert_example::Args::command();
    for arg in cmd.get_arguments() {
        assert!(arg.get_help().is_some(), "--{} has no help", arg.get_id());
    }
}
