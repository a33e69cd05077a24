//! Quoting for the few places where SQL text is built: identifiers always, literals only where the
//! replication protocol gives no way to bind (START_REPLICATION options, simple queries on the
//! walsender connection).

/// `"name"` with embedded quotes doubled. Every identifier pgapply writes goes through this.
pub fn quote_ident(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 2);
    out.push('"');
    for ch in name.chars() {
        if ch == '"' {
            out.push('"');
        }
        out.push(ch);
    }
    out.push('"');
    out
}

/// `schema.table`, both parts quoted.
pub fn qualified_name(schema: &str, table: &str) -> String {
    format!("{}.{}", quote_ident(schema), quote_ident(table))
}

/// SQL: whether a column type's values cannot go from one cluster to another in binary form:
/// - its binary form holds OIDs of the cluster it comes from, which mean nothing (or something
///   else) in another one: a type not built in (an enum, a domain, a composite; or an array of
///   one), or an OID alias type (regclass, regtype, regproc ... and their arrays), whose text
///   form is a name but whose binary form is the OID;
/// - it has no binary form (aclitem; or an array of it);
/// - PostgreSQL does not read back all it writes: an empty tsquery (`''`) is sent, and its
///   receive function refuses it ("malformed tsquery: operand not found"); an empty int2vector
///   or oidvector likewise ("invalid int2vector data"); these types and their arrays.
pub fn binary_unsafe_type_sql(type_oid: &str) -> String {
    format!(
        "({type_oid} >= 10000 OR pg_catalog.format_type({type_oid}, NULL) LIKE 'reg%' \
          OR {type_oid} IN ({}) \
          OR EXISTS (SELECT FROM pg_catalog.pg_type ty \
                     LEFT JOIN pg_catalog.pg_type el ON el.oid = ty.typelem AND ty.typlen = -1 \
                     WHERE ty.oid = {type_oid} \
                       AND (ty.typsend::oid = 0 OR ty.typreceive::oid = 0 \
                            OR el.typsend::oid = 0 OR el.typreceive::oid = 0)))",
        NOT_READ_BACK_TYPES
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Built-in types whose binary form PostgreSQL does not always read back (see
/// `binary_unsafe_type_sql`): tsquery, int2vector, oidvector and their arrays.
pub const NOT_READ_BACK_TYPES: [u32; 6] = [3615, 3645, 22, 1006, 30, 1013];

/// SQL for a type's name as `format_type` gives it, schema-qualified unless the type is
/// pg_catalog's: `format_type` leaves out the schema of a type the session's search_path finds,
/// and the name is compared with the other server's, whose search_path may differ. (An array is
/// named after its element: the element's schema decides.)
pub fn type_name_sql(type_oid: &str, typmod: &str) -> String {
    format!(
        "(SELECT CASE WHEN tn.nspname <> 'pg_catalog' AND pg_catalog.pg_type_is_visible(el.oid) \
                      THEN pg_catalog.quote_ident(tn.nspname) || '.' || pg_catalog.format_type(ty.oid, {typmod}) \
                      ELSE pg_catalog.format_type(ty.oid, {typmod}) END \
          FROM pg_catalog.pg_type ty \
          JOIN pg_catalog.pg_type el ON el.oid = CASE WHEN ty.typlen = -1 AND ty.typelem <> 0 THEN ty.typelem ELSE ty.oid END \
          JOIN pg_catalog.pg_namespace tn ON tn.oid = el.typnamespace \
          WHERE ty.oid = {type_oid})"
    )
}

/// A string literal that is correct whatever `standard_conforming_strings` says: `E'...'` with
/// quotes and backslashes escaped.
pub fn quote_literal(value: &str) -> String {
    let mut out = String::with_capacity(value.len() + 3);
    out.push_str("E'");
    for ch in value.chars() {
        match ch {
            '\'' => out.push_str("''"),
            '\\' => out.push_str("\\\\"),
            _ => out.push(ch),
        }
    }
    out.push('\'');
    out
}

/// A string literal to show in a message for the user to run: plain `'...'` (quotes doubled)
/// unless the value has a backslash, which only `quote_literal`'s form keeps whatever the
/// server's settings.
pub fn shown_literal(value: &str) -> String {
    if value.contains('\\') {
        quote_literal(value)
    } else {
        format!("'{}'", value.replace('\'', "''"))
    }
}

/// A string literal for replication commands (START_REPLICATION options): their grammar knows only
/// `'...'` with doubled quotes, and takes backslashes literally.
pub fn quote_replication_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// What to do about a target column that is generated while the source publishes its values:
/// make it plain (DROP EXPRESSION is 13+; `target_version` None when not known), or stop
/// publishing them.
pub fn generated_column_fix(table: &str, column: &str, target_version: Option<i32>) -> String {
    let plain = match target_version {
        Some(v) if v < 130000 => "PostgreSQL 12 has no DROP EXPRESSION: add a plain column, copy the values into it, drop the generated one and give the new one its name".to_owned(),
        Some(_) => format!("ALTER TABLE {table} ALTER COLUMN {column} DROP EXPRESSION"),
        None => format!("ALTER TABLE {table} ALTER COLUMN {column} DROP EXPRESSION, on PostgreSQL 13 or later"),
    };
    format!("make it a plain column on the target ({plain}); or, if the source's column is generated too and published by PostgreSQL 18's publish_generated_columns = stored (or a column list naming it), stop publishing its values (publish_generated_columns = none, or a column list without it): that holds for changes written from then on, while those already written still carry the values, so only the first way gets past them")
}

/// The server's `server_version_num` (150004 for 15.4): what a statement may use.
pub async fn server_version(client: &tokio_postgres::Client) -> Result<i32, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "SELECT pg_catalog.current_setting('server_version_num')::int",
            &[],
        )
        .await?
        .get(0))
}

/// The session's role and database, quoted, for a GRANT a message gives to paste (`...` where
/// they cannot be read).
pub async fn role_and_database(client: &tokio_postgres::Client) -> (String, String) {
    match client
        .query_one("SELECT current_user::text, current_database()::text", &[])
        .await
    {
        Ok(row) => (
            quote_ident(&row.get::<_, String>(0)),
            quote_ident(&row.get::<_, String>(1)),
        ),
        Err(_) => ("...".to_owned(), "...".to_owned()),
    }
}

/// With several hosts in a connection string: which one the session reached (` (connected to
/// host:port)`), as the description names the first.
pub async fn connected_to(
    client: &tokio_postgres::Client,
    config: &tokio_postgres::Config,
) -> String {
    if config.get_hosts().len() + config.get_hostaddrs().len() < 2 {
        return String::new();
    }
    client
        .query_one(
            "SELECT coalesce(host(inet_server_addr()), 'local socket') || ':' || coalesce(inet_server_port()::text, '')",
            &[],
        )
        .await
        .map(|r| format!(" (connected to {})", r.get::<_, String>(0)))
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers() {
        assert_eq!(quote_ident("a"), "\"a\"");
        assert_eq!(quote_ident("My \"Table\""), "\"My \"\"Table\"\"\"");
        assert_eq!(qualified_name("s p", "ü"), "\"s p\".\"ü\"");
    }

    #[test]
    fn literals() {
        assert_eq!(quote_literal("it's"), "E'it''s'");
        assert_eq!(quote_literal("a\\b"), "E'a\\\\b'");
        assert_eq!(
            quote_replication_literal("\"My Pub\",\"it's\""),
            "'\"My Pub\",\"it''s\"'"
        );
    }
}
