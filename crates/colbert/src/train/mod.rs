//! Fine-tuning a ColBERT model end to end in candle, with candle-maxsim's
//! kernels scoring: the encoder and the projection as `Var`s
//! ([`TrainableColBert`]), the losses of Sentence Transformers 6 /
//! PyLate ([`Loss`]), data in PyLate's JSONL conventions ([`data`]), a
//! trainer with AdamW, warm-up and decay, clipping, accumulation,
//! evaluation, checkpoints and resuming ([`train()`]), and checkpoints in the
//! PyLate layout that PyLate and Sentence Transformers 6 load.

pub mod data;
pub mod eval;
pub mod loss;
pub mod model;
pub mod optim;
pub mod trainer;

pub use data::{read_beir, read_distillation, read_triples, Example};
pub use eval::{evaluate, EvalSet, Metrics};
pub use loss::Loss;
pub use model::TrainableColBert;
pub use trainer::{loss_and_gradients, train, TrainConfig, TrainReport};
