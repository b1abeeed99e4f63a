package outbox

// insertedColumn is empty: SQLite's RETURNING cannot tell a row an upsert
// inserted from one it updated, so the plugin reads the existing keys
// first (keyReads).
func (sqliteDialect) insertedColumn() string { return "" }

// keyReads: the plugin reads the keys inside the statement's transaction.
// SQLite has one writer at a time, and a transaction that read the
// database can only write if nobody wrote in between (in WAL mode its
// write fails with SQLITE_BUSY otherwise), so what it reads is still true
// when the upsert runs. SQLite's ON CONFLICT DO UPDATE names its target.
func (sqliteDialect) keyReads() keyReads { return keyReads{} }

// errorAbortsTx is false: after a failed statement a SQLite transaction
// goes on, and commits what came before the failure.
func (sqliteDialect) errorAbortsTx() bool { return false }

// returnsRows: INSERT, UPDATE and DELETE all take RETURNING.
func (sqliteDialect) returnsRows(bool) bool { return true }
