// Command outboxctl inspects and operates the outbox table of a
// gorm-outbox service from a shell: what is waiting, why it failed, send
// it again, clean up, and verify the outbox's promises on the live table.
//
// Install it with
//
//	go install github.com/gorm-outbox/outbox/cmd/outboxctl@latest
//
// Every command takes the database as a URL in --db (or OUTBOX_DB):
// sqlite:./app.db or sqlite:file:app.db?_busy_timeout=5000 for SQLite,
// postgres://user:pass@host:5432/db?sslmode=disable (or postgresql://)
// for PostgreSQL. --table names the outbox table (default
// outbox_records); --output table|json chooses how rows are printed.
//
//	outboxctl stats                         counts by state, oldest due age, last failure
//	outboxctl list --state failed           messages, filtered, newest first
//	outboxctl show EVENT_ID                 one message whole
//	outboxctl requeue --type order.created  dead letters back to pending (--dry-run)
//	outboxctl purge --older-than 168h       delete old delivered messages
//	outboxctl migrate                       create the outbox tables
//	outboxctl check                         verify the table; exit 2 on a violation
//	outboxctl serve --addr :8080            the web dashboard (package outboxui)
//
// An error (an unreachable database, a table that does not exist, an
// event id that does not exist, a bad flag) is printed on one line to
// standard error and the exit status is 1. check prints each violation it
// finds on standard output, one a line, and then exits with status 2.
//
// outboxctl only reads the table, except for requeue, purge and migrate,
// and never delivers anything: it opens a dispatcher whose publisher
// refuses every batch, and never runs it.
package main
