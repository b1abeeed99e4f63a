// Package puresqlite holds the tests of the outbox on SQLite through the
// pure-Go driver github.com/glebarez/sqlite (modernc.org/sqlite), built
// with CGO_ENABLED=0. It is a module of its own so that programs using the
// outbox do not inherit that driver; the root package's
// TestPureGoSQLiteModule runs its tests.
package puresqlite
