// Command outboxctl inspects and operates the outbox table of a
// gorm-outbox service from a shell: what is waiting, why it failed, send
// it again, clean up, and verify the outbox's promises on the live table.
//
// Install it with
//
//	go install github.com/gorm-outbox/outbox/cmd/outboxctl@latest
//
// Every command takes the database in --db (or OUTBOX_DB):
// sqlite:./app.db or sqlite:file:app.db?_busy_timeout=5000 for SQLite;
// postgres://user:pass@host:5432/db?sslmode=disable (or postgresql://),
// or the key=value form GORM's docs use ('host=localhost user=gorm
// password=gorm dbname=gorm port=9920 sslmode=disable'), with values in
// single quotes when they hold spaces (password='a b', \' for a quote), as
// libpq reads it, for PostgreSQL;
// mysql://user:pass@host:3306/db?params (port 3306 when left out), or
// mysql:// followed by a DSN of the MySQL driver
// (mysql://user:pass@tcp(host:3306)/db), for MySQL and MariaDB, with
// parseTime=true added unless the URL sets it. --table names the outbox
// table (default outbox_records); --output table|json chooses how rows
// are printed. JSON names are in snake_case throughout.
//
//	outboxctl stats                         counts by state, oldest due age, last failure
//	outboxctl list --state failed           messages, filtered, newest first
//	outboxctl show EVENT_ID                 one message whole
//	outboxctl requeue --type order.created  dead letters back to pending (--dry-run)
//	outboxctl discard --id EVENT_ID         dead letters out of delivery for good (--dry-run)
//	outboxctl purge --older-than 7d         delete old delivered messages (--dry-run)
//	outboxctl migrate                       create the outbox tables
//	outboxctl check                         verify the table; exit 2 on a violation
//	outboxctl serve --addr :8080            the web dashboard (package outboxui)
//
// Ages (--older-than, --newer-than, --failed-before) are Go durations
// (90m, 36h) or days (7d, 1d12h). requeue and discard need a selection
// (--id, --type, --failed-before, or --all), take only failed messages,
// oldest failure first, at most --limit of them; --dry-run prints the
// messages they would take. discard moves each to the table
// <table>_discarded and logs its id; the messages its aggregate held back
// are delivered next.
//
// An error (an unreachable database, a table that does not exist, an
// event id that does not exist, a bad flag) is printed on one line to
// standard error and the exit status is 1. check prints each violation it
// finds on standard output, one a line, and then exits with status 2.
//
// outboxctl only reads the table, except for requeue, discard, purge and
// migrate (none of which changes anything with --dry-run),
// and never delivers anything: it opens a dispatcher whose publisher
// refuses every batch, and never runs it.
package main
