//! A PLAID engine on candle-maxsim's kernels: build a ColBERTv2 / fast-plaid
//! index from document embeddings, search it with the PLAID pipeline on a
//! GPU (or the CPU), add and delete documents, and split it into shards on
//! several devices.
//!
//! The directory layout is the one `fast-plaid` (lightonai/fast-plaid) reads
//! and writes, so an index built by either is searched by the other (tested
//! with indexes written by fast-plaid 1.4.6 and 1.7.0, and, in
//! bench/plaid_interop.py, each engine searching the other's index):
//!
//! | file | content |
//! |---|---|
//! | `metadata.json` | `num_chunks`, `nbits`, `num_documents`, `num_embeddings`, `num_partitions`, `avg_doclen` |
//! | `centroids.npy` | `[C, dim]` F16 unit centroids |
//! | `bucket_cutoffs.npy`, `bucket_weights.npy` | `[2^nbits − 1]`, `[2^nbits]` F32: how residuals are bucketed and decoded |
//! | `avg_residual.npy`, `cluster_threshold.npy` | calibration fast-plaid's update reads |
//! | `ivf.npy`, `ivf_lengths.npy` | the inverted file: each centroid's documents (I64), back to back, and the list lengths (I32) |
//! | `doclens.{i}.json`, `{i}.metadata.json` | token count of each document of chunk `i`; its offsets |
//! | `{i}.codes.npy`, `{i}.residuals.npy` | `[T_i]` I64 centroid codes, `[T_i, dim·nbits/8]` U8 packed residuals ([`BitOrder::ColBert`](candle_maxsim::residual::BitOrder)) |
//! | `merged_codes.npy`, `merged_residuals.npy` | fast-plaid ≥ 1.7: all chunks back to back (plus padding rows), in place of the per-chunk files |
//! | `deleted.json` | this crate's: deleted document ids (dropped from the inverted file by `compact`) |
//! | `delta_ivf.npy`, `delta_ivf_lengths.npy` | this crate's: the inverted lists of documents added since the last `compact` (which merges them into `ivf.npy`) |
//!
//! ## Updates
//!
//! [`create`], [`PlaidIndex::add`], [`PlaidIndex::delete`] and
//! [`PlaidIndex::compact`] write a new version of the directory beside it
//! (unchanged files hard-linked) and rename it into place: a process killed
//! at any moment leaves the index as it was before the update or as after,
//! and the next open finishes a commit cut between its renames and removes
//! what the dead process left. `delete` rewrites only `deleted.json`;
//! `add` writes the new chunks and the delta inverted lists and extends the
//! index in memory; `compact` merges the delta lists into the inverted file
//! and drops the deleted documents from it (what fast-plaid reads).
//! A build is written in `.NAME.building` with its progress: stopped at any
//! moment, the next `create` of the same documents and configuration
//! resumes from its last completed chunk and gives the same index.
//!
//! ## Building large collections
//!
//! [`create`] (or [`build`], which leaves the index unopened) reads the
//! documents through [`Documents`] a chunk at a time:
//! [`NpyDocuments`] memory-maps an `.npy` of token embeddings, and
//! [`DocumentsWriter`] writes one batch by batch as an encoder produces them,
//! so a collection need not fit in memory. The k-means sample is drawn from
//! the whole collection and clustered by spherical k-means (by default;
//! fast-plaid's Euclidean k-means is an option). Reading (a chunk ahead, on
//! a thread of its own for documents that come in host memory), coding on
//! the device and writing (three threads copying chunks back and writing
//! their files) overlap; the inverted lists are spilled to disk a chunk at
//! a time and merged into `ivf.npy` at the end (the host never holds them
//! whole). On an H200 a billion generated tokens build in 181 s (5.5 M
//! tokens/s, under 1 GB of host memory), three quarters of it the
//! assignment of every token to its centroid near the tensor cores' peak.
//!
//! ## Indexes larger than device memory
//!
//! [`PlaidIndex::load_with_device_budget`] opens an index within a number of
//! bytes of device memory: where the whole index does not fit, its residuals
//! (`dim·nbits/8` bytes per token, most of an index) stay in host memory
//! and each search copies to the device only the rows of the documents it
//! scores exactly; the results are those of the whole index on the device.
//! [`PlaidIndex::device_bytes_needed`] tells, from the files, what an index
//! takes. [`ShardedIndex`] spreads an index over several devices.
//!
//! ## Search
//!
//! [`PlaidIndex::search`] runs the PLAID pipeline on the index's device for a batch of queries
//! at a time; the host reads the queries once (non-finite entries are an
//! error, rows of zeros padding) and the final top-k, and the ops check
//! their inputs once at the end of each batch
//! ([`deferred_checks`](candle_maxsim::plaid::deferred_checks)):
//!
//! 1. query-centroid scores, `centroids · Qᵀ` (a `[C, Nq·Lq]` table for the
//!    approximate scores, F16 on a GPU, `Q · centroidsᵀ` rows for probing);
//! 2. per query token, the `n_ivf_probe` best centroids ([`topk_rows`](candle_maxsim::nn::topk_rows));
//! 3. their inverted lists, the query's candidates ([`plaid_candidates`](candle_maxsim::plaid::plaid_candidates)),
//!    less the deleted documents and those outside the subset;
//! 4. the centroid-only approximate score of every candidate
//!    ([`plaid_approx_candidates`](candle_maxsim::plaid::plaid_approx_candidates)), centroids below the optional
//!    `centroid_score_threshold` pruned; the best `n_full_scores / 4` kept;
//! 5. exact scores of those from their compressed residuals
//!    ([`maxsim_residual_pairs_offsets`](candle_maxsim::residual::maxsim_residual_pairs_offsets), the
//!    document offsets checked once at load), and the `top_k` best.
//!
//! Parameter names, defaults and the candidate cut are fast-plaid 1.7's: it
//! too decompresses only the best quarter of its `n_full_scores` candidates.
//!
//! fast-plaid features not covered: its metadata database (`metadata.db`,
//! filtering by SQL; pass the ids as a [`Subset`] instead), the update
//! buffer and outlier centroids it adds on `update`, and its renumbering on
//! `delete` (ids stay stable here).

// Each module uses only those below it in this order: shards, create,
// search, writer, ivf, kmeans, codec, index, documents, npy, store.
mod codec;
mod create;
mod documents;
mod index;
mod ivf;
mod kmeans;
mod npy;
mod search;
mod shards;
mod store;
mod writer;

pub use create::{build, create, IndexConfig};
pub use documents::{Documents, DocumentsWriter, NpyDocuments, PackedDocuments};
pub use index::PlaidIndex;
pub use search::{SearchParams, SearchResults, Subset};
pub use shards::ShardedIndex;
