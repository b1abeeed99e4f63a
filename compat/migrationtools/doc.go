// Package migrationtools holds the tests that outbox.Migrations apply with
// golang-migrate and with goose on PostgreSQL, MySQL (MariaDB) and SQLite,
// and that outbox.AutoMigrate and the tools agree on what applied. It is a
// module of its own so that programs using the outbox do not inherit the
// tools; the root package's TestMigrationToolsModule runs its tests.
package migrationtools
