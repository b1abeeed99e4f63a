package dialect

// InsertedColumn is empty: SQLite's RETURNING cannot tell a row an upsert
// inserted from one it updated, so the plugin reads the existing keys
// first (KeyReads).
func (sqliteDialect) InsertedColumn() string { return "" }

// KeyReads: the plugin reads the keys inside the statement's transaction.
// SQLite has one writer at a time, and a transaction that read the
// database can only write if nobody wrote in between (in WAL mode its
// write fails with SQLITE_BUSY otherwise), so what it reads is still true
// when the upsert runs. SQLite's ON CONFLICT DO UPDATE names its target.
func (sqliteDialect) KeyReads() KeyReads { return KeyReads{} }

// ErrorAbortsTx is false: after a failed statement a SQLite transaction
// goes on, and commits what came before the failure.
func (sqliteDialect) ErrorAbortsTx() bool { return false }

// ReturnsRows: INSERT, UPDATE and DELETE all take RETURNING.
func (sqliteDialect) ReturnsRows(bool) bool { return true }
