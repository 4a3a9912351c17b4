//! Set-based statements for group commits: every row of one statement travels as ONE
//! bound parameter, a JSON array of arrays (values in the order of the statement's
//! `$1…$k`), which the database unpacks itself (`jsonb_each` on SQLite, whose row values
//! come out as binary JSON so each `->>` is a lookup, not a re-parse of the row's text;
//! `json_array_elements` on PostgreSQL).
//!
//! Why: a multi-row `VALUES (…), (…)` statement's text depends on its row count, so it is
//! parsed again for every new size, and each of its thousands of values is a separate bind.
//! Here the statement text is fixed: it is prepared once per connection and cached, and a
//! batch of any size costs one bind per statement. On SQLite a whole transaction's
//! statements go to the connection thread as one multi-statement query (one round trip).
//!
//! The `INSERT … SELECT` forms are generated from the one-row `INSERT … VALUES (…)`
//! constants of `ledger.rs`, so the column lists and conflict rules exist once.
//! Only placeholders and the statements' own text become SQL; no value ever does.

use serde::Serialize;

/// The SQL dialect of a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dialect {
    Sqlite,
    Postgres,
}

impl Dialect {
    /// The rows of the JSON array bound as the statement's one parameter, as a table with
    /// one column `value` (each row's array).
    pub(crate) fn rows_source(self) -> &'static str {
        match self {
            Dialect::Sqlite => "jsonb_each(?)",
            Dialect::Postgres => "json_array_elements($1::json) AS r(value)",
        }
    }

    /// Element `i` of a row array, typed for `column`.
    pub(crate) fn element(self, i: usize, column: &str) -> String {
        match self {
            // SQLite's `->>` returns INTEGER for numbers and booleans, TEXT for strings.
            Dialect::Sqlite => format!("value ->> {i}"),
            Dialect::Postgres => format!("(value ->> {i})::{}", pg_type(column)),
        }
    }

    /// `column IN` the ids of a JSON array of strings bound as the one parameter.
    pub(crate) fn in_ids(self, column: &str) -> String {
        match self {
            Dialect::Sqlite => format!("{column} IN (SELECT value FROM json_each(?))"),
            Dialect::Postgres => {
                format!("{column} = ANY (ARRAY(SELECT json_array_elements_text($1::json)))")
            }
        }
    }
}

/// The PostgreSQL type of a ledger column (see `migrations/postgres`).
fn pg_type(column: &str) -> &'static str {
    match column {
        "redelivered" | "model_called" | "cancel_requested" | "cancel_confirmed" | "complete" => {
            "boolean"
        }
        "attempt" | "attempts" | "backend_calls" | "prompt_tokens" | "completion_tokens"
        | "request_tokens" | "request_max_tokens" | "status" | "bytes" | "line_count"
        | "line_no" | "total" | "cursor" | "cancel_cursor" => "bigint",
        c if c.ends_with("_ms") => "bigint",
        _ => "text",
    }
}

/// `sql`, an `INSERT INTO t (c1, …) VALUES (e1, …) …` whose tuple holds `$n` placeholders
/// and literals, as `INSERT INTO t (c1, …) SELECT e1', … FROM <rows> WHERE true …`, where
/// `$n` becomes element n-1 of each row array. (`WHERE true` keeps SQLite's parser from
/// reading the `ON CONFLICT` that follows as a join constraint.)
pub(crate) fn insert_from_json(sql: &str, dialect: Dialect) -> String {
    let values = sql
        .find(" VALUES (")
        .expect("an INSERT … VALUES (…) statement");
    let open = values + " VALUES (".len();
    let close = open + sql[open..].find(')').expect("a closed VALUES tuple");
    let cols_open = sql[..values].find('(').expect("a column list");
    let columns: Vec<&str> = sql[cols_open + 1..values]
        .trim_end()
        .trim_end_matches(')')
        .split(',')
        .map(str::trim)
        .collect();
    let exprs: Vec<&str> = sql[open..close].split(',').map(str::trim).collect();
    assert_eq!(columns.len(), exprs.len(), "one value per column: {sql}");
    let select: Vec<String> = exprs
        .iter()
        .zip(&columns)
        .map(|(e, c)| match e.strip_prefix('$') {
            Some(n) => {
                let n: usize = n.parse().expect("a numbered placeholder");
                dialect.element(n - 1, c)
            }
            None => (*e).to_owned(),
        })
        .collect();
    format!(
        "{} SELECT {} FROM {} WHERE true{}",
        &sql[..values],
        select.join(", "),
        dialect.rows_source(),
        &sql[close + 1..]
    )
}

/// A JSON array of row arrays, written straight into one string.
#[derive(Default)]
pub(crate) struct JsonRows {
    buf: Vec<u8>,
    rows: usize,
}

impl JsonRows {
    /// Append one row; `push` writes its values in placeholder order.
    pub(crate) fn row(&mut self, push: impl FnOnce(&mut Row<'_>)) {
        self.buf.push(if self.rows == 0 { b'[' } else { b',' });
        self.buf.push(b'[');
        let mut row = Row {
            buf: &mut self.buf,
            first: true,
        };
        push(&mut row);
        self.buf.push(b']');
        self.rows += 1;
    }

    pub(crate) fn len(&self) -> usize {
        self.rows
    }

    /// The JSON text (`[]` when no row was added).
    pub(crate) fn finish(mut self) -> String {
        if self.rows == 0 {
            return "[]".to_owned();
        }
        self.buf.push(b']');
        String::from_utf8(self.buf).expect("serde_json writes UTF-8")
    }
}

/// One row being written by [`JsonRows::row`].
pub(crate) struct Row<'a> {
    buf: &'a mut Vec<u8>,
    first: bool,
}

impl Row<'_> {
    /// Append one value (`None` becomes `null`).
    pub(crate) fn v<T: Serialize + ?Sized>(&mut self, value: &T) -> &mut Self {
        if !self.first {
            self.buf.push(b',');
        }
        self.first = false;
        serde_json::to_writer(&mut *self.buf, value).expect("serializing into memory");
        self
    }
}

/// A JSON array of `items` (ids, for [`Dialect::in_ids`]).
pub(crate) fn json_array<T: Serialize>(items: &[T]) -> String {
    serde_json::to_string(items).expect("serializing into memory")
}

#[cfg(test)]
mod tests {
    use super::*;

    const SQL: &str = "INSERT INTO t (a, b_ms, flag, c) VALUES ($1, $2, $3, 'x') \
         ON CONFLICT (a) DO UPDATE SET b_ms = excluded.b_ms";

    #[test]
    fn insert_from_json_maps_placeholders_to_row_elements() {
        assert_eq!(
            insert_from_json(SQL, Dialect::Sqlite),
            "INSERT INTO t (a, b_ms, flag, c) SELECT value ->> 0, value ->> 1, value ->> 2, \
             'x' FROM jsonb_each(?) WHERE true ON CONFLICT (a) DO UPDATE SET b_ms = excluded.b_ms"
        );
        let pg = insert_from_json(
            SQL.replace("flag", "redelivered").as_str(),
            Dialect::Postgres,
        );
        assert_eq!(
            pg,
            "INSERT INTO t (a, b_ms, redelivered, c) SELECT (value ->> 0)::text, \
             (value ->> 1)::bigint, (value ->> 2)::boolean, 'x' \
             FROM json_array_elements($1::json) AS r(value) WHERE true \
             ON CONFLICT (a) DO UPDATE SET b_ms = excluded.b_ms"
        );
    }

    #[test]
    fn json_rows_escape_strings_and_write_nulls() {
        let mut rows = JsonRows::default();
        assert_eq!(JsonRows::default().finish(), "[]");
        rows.row(|r| {
            r.v("a\"b").v(&Some(5i64)).v(&None::<i64>).v(&true);
        });
        rows.row(|r| {
            r.v("ü\n");
        });
        assert_eq!(rows.len(), 2);
        assert_eq!(rows.finish(), r#"[["a\"b",5,null,true],["ü\n"]]"#);
        assert_eq!(json_array(&["x", "y\""]), r#"["x","y\""]"#);
    }
}
