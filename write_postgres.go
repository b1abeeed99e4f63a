package outbox

// insertedColumn: a row version that an INSERT ... ON CONFLICT DO UPDATE
// inserted has no deleting transaction yet (xmax = 0); one it updated
// carries the updating transaction's id in xmax.
func (postgresDialect) insertedColumn() string { return "(xmax = 0)" }

// errorAbortsTx is true: after a failed statement, a PostgreSQL
// transaction refuses every other statement and its COMMIT rolls back.
func (postgresDialect) errorAbortsTx() bool { return true }
