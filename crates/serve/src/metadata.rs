//! Document metadata in SQLite, filtered by SQL conditions with bound
//! parameters (as fast-plaid / PyLate's `filtering.where`).
//!
//! One table, `metadata`: `_id INTEGER PRIMARY KEY` (the document id),
//! `_json` (the metadata object as given, returned by [`Metadata::get`]),
//! and one column per top-level key seen so far, added with `ALTER TABLE`
//! the first time a key appears. Column values are typed from JSON:
//! integers as INTEGER, other numbers as REAL, strings as TEXT, booleans as
//! 0 / 1, null as NULL, arrays and objects as their JSON text (reachable
//! with `json_extract`). Keys are identifiers (`[A-Za-z][A-Za-z0-9_]*`, at
//! most 64 characters; a leading `_` is reserved), compared without regard
//! to case as SQLite compares column names.
//!
//! A filter is `SELECT _id FROM metadata WHERE (<condition>)` with the
//! parameters bound (never spliced into the text), run on one of a few
//! read-only connections with `PRAGMA query_only`: a condition cannot write,
//! cannot hold a second statement (`;` is refused, and SQLite's prepare
//! takes one statement), and is interrupted past a time limit. Filters and
//! lookups of concurrent requests run side by side on those connections
//! (WAL readers do not wait for each other or for the writer).
//!
//! A filter's ids are kept until the next write through this store
//! (at most [`FILTER_CACHE_ENTRIES`] filters): concurrent requests with the
//! same condition and parameters read the table once, not once each (a full
//! scan per request bounded filtered search at ~1 300 requests per second
//! over 136 000 rows). Conditions naming SQL functions whose result can
//! change from one run to the next (`random`, any date or time function,
//! `changes`) and filters matching more than 4 M ids are never kept. The
//! store assumes it is the database's only writer.

use crate::error::{Error, Result};
use rusqlite::{types::Value as SqlValue, Connection, OpenFlags};
use serde_json::{Map, Value};
use std::collections::{HashMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A document's metadata: a JSON object.
pub type Row = Map<String, Value>;

/// Parameters bound per statement at most (SQLite's default limit is 32766).
const IDS_PER_STATEMENT: usize = 500;
/// Filters whose ids are kept at most, and ids kept in all (64 MB).
const FILTER_CACHE_ENTRIES: usize = 64;
const FILTER_CACHE_IDS: usize = 1 << 24;
/// The largest string or blob a filter may make (and metadata object read).
const MAX_VALUE_BYTES: i32 = 16 << 20;
/// Metadata columns at most (SQLite allows 2000 in a table).
const MAX_COLUMNS: usize = 1000;

/// Read-only connections at most: filters of concurrent requests run on
/// separate ones (each a full scan at worst).
const MAX_READERS: usize = 8;

/// The metadata store of an index: a read-write connection for updates and
/// a few read-only ones for filters and lookups (`Metadata` is `Sync`:
/// reads take `&self` and run concurrently).
pub struct Metadata {
    conn: Mutex<Connection>,
    readers: Vec<Reader>,
    /// Where the next read starts looking for a free reader.
    next: AtomicUsize,
    /// The user columns, as created.
    columns: Vec<String>,
    filter_timeout: Duration,
    epoch: Instant,
    cache: Mutex<FilterCache>,
}

/// The ids of recent filters, keyed by condition and parameters (JSON
/// text), emptied by every write; the oldest leaves first.
#[derive(Default)]
struct FilterCache {
    ids: HashMap<(String, String), Arc<Vec<u32>>>,
    order: VecDeque<(String, String)>,
    total: usize,
}

impl FilterCache {
    fn insert(&mut self, key: (String, String), ids: Arc<Vec<u32>>) {
        if ids.len() > FILTER_CACHE_IDS / 4 || self.ids.contains_key(&key) {
            return;
        }
        while self.order.len() >= FILTER_CACHE_ENTRIES || self.total + ids.len() > FILTER_CACHE_IDS {
            let Some(old) = self.order.pop_front() else { break };
            self.total -= self.ids.remove(&old).map_or(0, |v| v.len());
        }
        self.total += ids.len();
        self.order.push_back(key.clone());
        self.ids.insert(key, ids);
    }
}

/// Whether `condition` may be kept: it names none of SQLite's functions
/// whose result can change from one run to the next (`date()` and `time()`
/// mean now, and so does a bound `'now'`; a column name containing one of
/// these words only costs the cache).
fn cacheable(condition: &str) -> bool {
    let c = condition.to_ascii_lowercase();
    !["random", "now", "current_", "changes", "last_insert_rowid", "date", "time", "julianday", "unixepoch"]
        .iter()
        .any(|w| c.contains(w))
}

/// A read-only connection and its running filter's deadline, in ns after
/// `Metadata::epoch` (`u64::MAX`: none), read by its progress handler.
struct Reader {
    conn: Mutex<Connection>,
    deadline: Arc<AtomicU64>,
}

fn lock(m: &Mutex<Connection>) -> MutexGuard<'_, Connection> {
    // A panic under the lock leaves the connection usable (SQLite rolls back).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Metadata {
    /// Opens (creating it if absent) the SQLite database at `path`: WAL
    /// journal, `synchronous = FULL` (a committed transaction survives a
    /// crash of the process or of the machine). Filters running longer than
    /// `filter_timeout` are interrupted.
    pub fn open(path: impl AsRef<Path>, filter_timeout: Duration) -> Result<Self> {
        let path = path.as_ref();
        let ctx = |e: rusqlite::Error| Error::internal(format!("metadata: {}: {e}", path.display()));
        let conn = Connection::open(path).map_err(ctx)?;
        conn.busy_timeout(Duration::from_secs(10)).map_err(ctx)?;
        conn.pragma_update(None, "journal_mode", "WAL").map_err(ctx)?;
        conn.pragma_update(None, "synchronous", "FULL").map_err(ctx)?;
        conn.execute_batch("CREATE TABLE IF NOT EXISTS metadata (_id INTEGER PRIMARY KEY, _json TEXT)").map_err(ctx)?;
        let epoch = Instant::now();
        let n_readers = std::thread::available_parallelism().map_or(1, |n| n.get()).min(MAX_READERS);
        let mut readers = Vec::with_capacity(n_readers);
        for _ in 0..n_readers {
            let mut read =
                Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
                    .map_err(ctx)?;
            read.busy_timeout(Duration::from_secs(10)).map_err(ctx)?;
            read.pragma_update(None, "query_only", true).map_err(ctx)?;
            let deadline = Arc::new(AtomicU64::new(u64::MAX));
            let d = deadline.clone();
            read.progress_handler(1000, Some(move || epoch.elapsed().as_nanos() as u64 > d.load(Ordering::Relaxed)))
                .map_err(ctx)?;
            // A filter cannot build huge strings or blobs (`randomblob(1e9)`).
            read.set_limit(rusqlite::limits::Limit::SQLITE_LIMIT_LENGTH, MAX_VALUE_BYTES).map_err(ctx)?;
            readers.push(Reader { conn: Mutex::new(read), deadline });
        }
        let mut m = Self {
            conn: Mutex::new(conn),
            readers,
            next: AtomicUsize::new(0),
            columns: Vec::new(),
            filter_timeout,
            epoch,
            cache: Mutex::default(),
        };
        m.load_columns()?;
        Ok(m)
    }

    /// A reader and its connection: the first free one from a rotating
    /// start, or (all busy) the start's, waited for.
    fn reader(&self) -> (&Reader, MutexGuard<'_, Connection>) {
        let n = self.readers.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        for i in 0..n {
            let r = &self.readers[(start + i) % n];
            if let Ok(c) = r.conn.try_lock() {
                return (r, c);
            }
        }
        let r = &self.readers[start];
        (r, lock(&r.conn))
    }

    /// Reads the user columns from the schema.
    fn load_columns(&mut self) -> Result<()> {
        let conn = self.conn.get_mut().unwrap_or_else(|p| p.into_inner());
        let mut st = conn.prepare("SELECT name FROM pragma_table_info('metadata')")?;
        let names = st.query_map([], |r| r.get::<_, String>(0))?.collect::<rusqlite::Result<Vec<_>>>()?;
        drop(st);
        self.columns = names.into_iter().filter(|n| !n.starts_with('_')).collect();
        Ok(())
    }

    /// The user columns (the metadata keys seen so far).
    pub fn columns(&self) -> &[String] {
        &self.columns
    }

    /// Number of rows.
    pub fn len(&self) -> Result<usize> {
        let n: i64 = self.reader().1.query_row("SELECT count(*) FROM metadata", [], |r| r.get(0))?;
        Ok(n as usize)
    }

    /// Whether there are no rows.
    pub fn is_empty(&self) -> Result<bool> {
        Ok(self.len()? == 0)
    }

    /// Brings the table in line with an index of `num_documents` documents
    /// of which `deleted` are deleted, after a process died between the two
    /// commits of an update (see the crate docs for the order): rows of ids
    /// `>= num_documents` (an add whose index commit never happened) and of
    /// deleted ids (a delete whose metadata commit never happened) are
    /// removed; live documents without a row (an index built elsewhere) get
    /// an empty one, so that every live document is a row. One transaction.
    pub fn reconcile(&mut self, num_documents: usize, deleted: &[u32]) -> Result<()> {
        self.forget_filters();
        let conn = self.conn.get_mut().unwrap_or_else(|p| p.into_inner());
        let tx = conn.transaction()?;
        tx.execute("DELETE FROM metadata WHERE _id >= ?1 OR _id < 0", [num_documents as i64])?;
        delete_ids(&tx, deleted)?;
        let rows: i64 = tx.query_row("SELECT count(*) FROM metadata", [], |r| r.get(0))?;
        if rows as usize != num_documents - deleted.len().min(num_documents) {
            tx.execute(
                "WITH RECURSIVE c(x) AS (SELECT 0 UNION ALL SELECT x + 1 FROM c WHERE x + 1 < ?1)
                 INSERT OR IGNORE INTO metadata (_id) SELECT x FROM c WHERE ?1 > 0",
                [num_documents as i64],
            )?;
            delete_ids(&tx, deleted)?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Checks `rows` (one optional object per document) as [`Metadata::add`]
    /// would take them, without writing: `Err` (422) naming `metadata[i]`.
    pub fn check_rows(rows: &[Option<Row>]) -> Result<()> {
        for (i, row) in rows.iter().enumerate() {
            let Some(row) = row else { continue };
            let mut seen: Vec<String> = Vec::with_capacity(row.len());
            for key in row.keys() {
                check_key(key).map_err(|m| Error::unprocessable(format!("metadata[{i}]: {m}")))?;
                let folded = key.to_ascii_lowercase();
                if seen.contains(&folded) {
                    return Err(Error::unprocessable(format!(
                        "metadata[{i}]: two keys name column `{key}` (keys are compared without regard to case)"
                    )));
                }
                seen.push(folded);
            }
        }
        Ok(())
    }

    /// Writes the metadata of documents `ids` (one optional object each; a
    /// row replaces any row of the same id) in one transaction, committed
    /// (durably) on return. New keys become columns.
    pub fn add(&mut self, ids: &[u32], rows: &[Option<Row>]) -> Result<()> {
        if ids.len() != rows.len() {
            return Err(Error::unprocessable(format!("metadata: {} objects for {} documents", rows.len(), ids.len())));
        }
        Self::check_rows(rows)?;
        self.forget_filters();
        let result = self.add_tx(ids, rows);
        if result.is_err() {
            // An ALTER TABLE rolled back with the transaction: the cached columns may be stale.
            let _ = self.load_columns();
        }
        result
    }

    fn add_tx(&mut self, ids: &[u32], rows: &[Option<Row>]) -> Result<()> {
        let conn = self.conn.get_mut().unwrap_or_else(|p| p.into_inner());
        let tx = conn.transaction()?;
        for (&id, row) in ids.iter().zip(rows) {
            let empty = Row::new();
            let row = row.as_ref().unwrap_or(&empty);
            let mut cols = Vec::with_capacity(row.len());
            let mut values: Vec<SqlValue> = vec![SqlValue::Integer(id as i64)];
            values.push(match row.is_empty() {
                true => SqlValue::Null,
                false => SqlValue::Text(Value::Object(row.clone()).to_string()),
            });
            for (key, v) in row {
                let col = match self.columns.iter().find(|c| c.eq_ignore_ascii_case(key)) {
                    Some(c) => c.clone(),
                    None => {
                        if self.columns.len() >= MAX_COLUMNS {
                            return Err(Error::unprocessable(format!(
                                "metadata: key `{key}` would be column {} of at most {MAX_COLUMNS}",
                                self.columns.len() + 1
                            )));
                        }
                        // The key is an identifier (checked): quoting is for keywords.
                        tx.execute_batch(&format!("ALTER TABLE metadata ADD COLUMN \"{key}\""))?;
                        self.columns.push(key.clone());
                        key.clone()
                    }
                };
                cols.push(format!("\"{col}\""));
                values.push(json_to_sql(v));
            }
            let names = std::iter::once("_id".to_string()).chain(std::iter::once("_json".into())).chain(cols);
            let names: Vec<String> = names.collect();
            let marks = vec!["?"; names.len()].join(", ");
            let sql = format!("INSERT OR REPLACE INTO metadata ({}) VALUES ({marks})", names.join(", "));
            tx.prepare_cached(&sql)?.execute(rusqlite::params_from_iter(values))?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Empties the filter cache (before a write: a failed one may have
    /// changed rows before rolling back, so the cache never outlives it).
    fn forget_filters(&mut self) {
        *self.cache.get_mut().unwrap_or_else(|p| p.into_inner()) = FilterCache::default();
    }

    /// Removes the rows of `ids` (absent ones ignored) in one transaction;
    /// returns how many there were.
    pub fn delete(&mut self, ids: &[u32]) -> Result<usize> {
        self.forget_filters();
        let conn = self.conn.get_mut().unwrap_or_else(|p| p.into_inner());
        let tx = conn.transaction()?;
        let n = delete_ids(&tx, ids)?;
        tx.commit()?;
        Ok(n)
    }

    /// The ids (ascending) of the rows where `condition` holds, its `?`
    /// placeholders bound to `params` in order (numbers, strings, booleans
    /// as 0 / 1, null). `Err` (400) naming `filter.where` for a condition
    /// that is not one SQL expression over the table's columns, that takes
    /// longer than the filter timeout, or `filter.params` for a count or
    /// value that does not fit it. Kept until the next write (see the
    /// module docs).
    pub fn filter(&self, condition: &str, params: &[Value]) -> Result<Arc<Vec<u32>>> {
        let bad = |m: String| Error::bad_request(format!("filter.where: {m}"));
        if condition.trim().is_empty() {
            return Err(bad("is empty".into()));
        }
        if condition.contains(';') || condition.contains('\0') {
            return Err(bad("must be one SQL condition: `;` and NUL are not allowed".into()));
        }
        let mut bound = Vec::with_capacity(params.len());
        for (i, p) in params.iter().enumerate() {
            match p {
                Value::Array(_) | Value::Object(_) => {
                    return Err(Error::bad_request(format!(
                        "filter.params[{i}]: must be a number, string, boolean or null"
                    )))
                }
                v => bound.push(json_to_sql(v)),
            }
        }
        let key = (condition.to_string(), Value::Array(params.to_vec()).to_string());
        let cache = || self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(ids) = cache().ids.get(&key) {
            return Ok(ids.clone());
        }
        // A newline before the closing parenthesis: a trailing `--` comment
        // cannot swallow it.
        let sql = format!("SELECT _id FROM metadata WHERE ({condition}\n) ORDER BY _id");
        let (reader, conn) = self.reader();
        let mut st = conn.prepare(&sql).map_err(|e| bad(e.to_string()))?;
        if st.parameter_count() != bound.len() {
            return Err(Error::bad_request(format!(
                "filter.params: the condition has {} placeholders, {} params given",
                st.parameter_count(),
                bound.len()
            )));
        }
        let until = self.epoch.elapsed() + self.filter_timeout;
        reader.deadline.store(until.as_nanos() as u64, Ordering::Relaxed);
        let ids = st
            .query_map(rusqlite::params_from_iter(bound), |r| r.get::<_, i64>(0))
            .and_then(|rows| rows.collect::<rusqlite::Result<Vec<i64>>>());
        reader.deadline.store(u64::MAX, Ordering::Relaxed);
        let ids = ids.map_err(|e| match e {
            rusqlite::Error::SqliteFailure(f, _) if f.code == rusqlite::ErrorCode::OperationInterrupted => {
                bad(format!("took longer than {} ms", self.filter_timeout.as_millis()))
            }
            e => bad(e.to_string()),
        })?;
        let ids: Arc<Vec<u32>> = Arc::new(ids.into_iter().filter_map(|i| u32::try_from(i).ok()).collect());
        if cacheable(condition) {
            cache().insert(key, ids.clone());
        }
        Ok(ids)
    }

    /// The metadata objects of `ids`, in that order (`None`: no row, or a
    /// row without metadata).
    pub fn get(&self, ids: &[u32]) -> Result<Vec<Option<Row>>> {
        let mut found: std::collections::HashMap<u32, Row> = std::collections::HashMap::new();
        let (_, conn) = self.reader();
        for chunk in ids.chunks(IDS_PER_STATEMENT) {
            let marks = vec!["?"; chunk.len()].join(", ");
            let sql = format!("SELECT _id, _json FROM metadata WHERE _json IS NOT NULL AND _id IN ({marks})");
            let mut st = conn.prepare_cached(&sql)?;
            let rows = st.query_map(rusqlite::params_from_iter(chunk.iter().map(|&i| i as i64)), |r| {
                Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
            })?;
            for row in rows {
                let (id, text) = row?;
                if let Ok(Value::Object(m)) = serde_json::from_str(&text) {
                    found.insert(id as u32, m);
                }
            }
        }
        Ok(ids.iter().map(|i| found.get(i).cloned()).collect())
    }
}

/// Deletes the rows of `ids` in `tx`; returns how many there were.
fn delete_ids(tx: &rusqlite::Transaction, ids: &[u32]) -> Result<usize> {
    let mut n = 0;
    for chunk in ids.chunks(IDS_PER_STATEMENT) {
        let marks = vec!["?"; chunk.len()].join(", ");
        let sql = format!("DELETE FROM metadata WHERE _id IN ({marks})");
        n += tx.execute(&sql, rusqlite::params_from_iter(chunk.iter().map(|&i| i as i64)))?;
    }
    Ok(n)
}

/// `Err` (a message) unless `key` may name a column.
fn check_key(key: &str) -> std::result::Result<(), String> {
    let mut chars = key.chars();
    let ok = key.len() <= 64
        && chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    match ok {
        true => Ok(()),
        false => Err(format!(
            "key `{}` must be an identifier: a letter, then letters, digits or `_`, at most 64 characters",
            key.chars().take(80).collect::<String>()
        )),
    }
}

/// A JSON value as SQLite stores it (see the module docs).
fn json_to_sql(v: &Value) -> SqlValue {
    match v {
        Value::Null => SqlValue::Null,
        Value::Bool(b) => SqlValue::Integer(*b as i64),
        Value::Number(n) => match n.as_i64() {
            Some(i) => SqlValue::Integer(i),
            None => SqlValue::Real(n.as_f64().unwrap_or(f64::NAN)),
        },
        Value::String(s) => SqlValue::Text(s.clone()),
        v => SqlValue::Text(v.to_string()),
    }
}
