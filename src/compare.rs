//! Comparing a table on two servers: row count and a digest of all rows in key order.

use tokio_postgres::Client;

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableDigest {
    pub rows: i64,
    pub md5: String,
}

/// Count and md5 of the rows' text form, ordered by every column (so tables without a key
/// compare too, duplicates included). `table` must already be quoted. (`r.*`: a column named `r`
/// would stand for the whole row.)
pub async fn table_digest(client: &Client, table: &str) -> Result<TableDigest> {
    let sql = format!(
        "SELECT count(*), coalesce(md5(string_agg((r.*)::text, E'\\n' ORDER BY (r.*)::text)), '') FROM {table} AS r"
    );
    let row = client
        .query_one(&sql, &[])
        .await
        .map_err(|e| Error::postgres(format!("reading {table}"), e))?;
    Ok(TableDigest {
        rows: row.get(0),
        md5: row.get(1),
    })
}
