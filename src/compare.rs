//! Comparing a table on two servers: row count and a digest of all rows in key order.

use tokio_postgres::Client;

use crate::error::{Error, Result};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableDigest {
    pub rows: i64,
    pub md5: String,
}

/// Count and md5 of the rows' text form, ordered by every column (so tables without a key
/// compare too, duplicates included), on both servers. `table` must already be quoted. (`r.*`: a
/// column named `r` would stand for the whole row.) The text is printed with the same settings
/// on both servers, whatever their sessions say: times in UTC, money in the C locale's form,
/// floats as verify prints them (exact, or to 15 digits when one side runs PostgreSQL 11 or
/// older, which prints floats differently).
pub async fn table_digests(
    source: &Client,
    target: &Client,
    table: &str,
) -> Result<(TableDigest, TableDigest)> {
    let (s, t) = (
        crate::sql::server_version(source)
            .await
            .map_err(|e| Error::postgres("reading the source's version", e))?,
        crate::sql::server_version(target)
            .await
            .map_err(|e| Error::postgres("reading the target's version", e))?,
    );
    let digits = crate::verify::float_digits(s, t);
    Ok((
        table_digest(source, table, digits).await?,
        table_digest(target, table, digits).await?,
    ))
}

async fn table_digest(client: &Client, table: &str, float_digits: i32) -> Result<TableDigest> {
    let context = |e| Error::postgres(format!("reading {table}"), e);
    client
        .batch_execute(&format!(
            "BEGIN; SET LOCAL timezone = 'UTC'; SET LOCAL datestyle = ISO; \
             SET LOCAL intervalstyle = postgres; SET LOCAL extra_float_digits = {float_digits}; \
             SET LOCAL bytea_output = hex; SET LOCAL lc_monetary = 'C'"
        ))
        .await
        .map_err(context)?;
    let sql = format!(
        "SELECT count(*), coalesce(md5(string_agg((r.*)::text, E'\\n' ORDER BY (r.*)::text)), '') FROM {table} AS r"
    );
    let row = client.query_one(&sql, &[]).await;
    let _ = client.batch_execute("COMMIT").await;
    let row = row.map_err(context)?;
    Ok(TableDigest {
        rows: row.get(0),
        md5: row.get(1),
    })
}
