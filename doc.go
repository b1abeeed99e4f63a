// Package outbox implements the transactional outbox pattern for GORM.
//
// A service that writes business data and must tell other systems about it
// cannot simply write the row and then send a message: a crash in between
// loses the message, and sending first announces data that may still roll
// back. The outbox makes the event data: it is written in the same database
// transaction as the business row, and a dispatcher delivers it later.
//
// # Writing events
//
// Register the plugin and create or upgrade its tables at start-up (the
// schema is versioned; [Migrations] holds its SQL files, which
// golang-migrate and goose apply as they are):
//
//	db.Use(outbox.Plugin())
//	outbox.AutoMigrate(db)
//
// A model opts in by implementing [Emitter]: after every create, update and
// delete of the model, the plugin calls OutboxEvents and writes the events
// through the statement's own transaction, so they commit if and only if
// the business write commits. Types you cannot change get their events
// through [RegisterEmitter]; events not tied to a model write are recorded
// with [Publish] inside the caller's transaction. [Transaction] is
// db.Transaction that also wakes the dispatchers once it has committed. An
// event that cannot be encoded fails the write, and nothing is written.
//
// Each event becomes a row of the outbox_records table with a unique
// event_id, a unique idempotency_key (writing a key that exists is a no-op)
// and an aggregate_sequence that counts 1, 2, 3, ... per
// (aggregate_type, aggregate_id) in commit order, without gaps.
//
// # Delivering events
//
// A [Dispatcher] claims due rows, hands them in a [Batch] to a [Publisher]
// outside any transaction, and settles each one:
//
//	pending ──claim──▶ delivering ──accepted──▶ delivered ──Cleanup──▶ deleted
//	                     │    ▲
//	      publish failed │    │ due again (exponential backoff)
//	                     ▼    │
//	                     retry ─── max attempts or Permanent ──▶ failed
//	                                                               │
//	pending ◀──── RetryFailed (exhausted only, up to 3 times) ◀────┤
//	pending ◀──── Requeue (a person, any failed row) ◀─────────────┘
//
// A claimed row is leased: if its dispatcher dies, the row is claimed again
// once the lease passes, so every committed event is delivered at least
// once and consumers deduplicate on Message.EventID. Rows of a transaction
// that has not committed are invisible to the claim, so nothing is
// delivered early, and nothing of a rolled-back transaction ever is. Per
// aggregate, sequence n+1 is never handed to a publisher before sequence n
// was accepted; a dead-lettered event holds back the rest of its own
// aggregate, and of no other, until it comes back.
//
// A dead letter stays dead unless its failure was transient: the
// retry_failed sweep ([Dispatcher.RetryFailed]) revives only events that
// ran out of attempts, at most [WithMaxRevivals] times; a [Permanent]
// error, an event type without a handler and a row that cannot be read
// stay failed until a person moves them with [Dispatcher.Requeue].
//
// A claim is one short transaction that takes, of the batch size of oldest
// due events, those that keep each aggregate's order: those whose
// predecessor was delivered, or is in the same batch just before them.
// Events held back behind one that waits for a retry or was dead-lettered
// are parked behind it, out of the next claims' way; dispatchers that hold
// each other back claim from shards of the aggregates. The lease is
// locked_until: a row whose lease lies ahead is never claimed.
//
// [Dispatcher.Run] dispatches continuously; [NewScheduler] instead drives
// dispatch, the retry_failed sweep and cleanup from a robfig/cron/v3
// schedule. Publishers shipped with the library: [Handlers] for in-process
// handlers by event type, [PublisherFunc] for a function, and, each in a
// package of its own, outboxhttp (an HTTP endpoint, the body signed when
// given a secret), outboxnats (NATS JetStream), outboxkafka (Kafka,
// through franz-go), outboxamqp (RabbitMQ, with publisher confirms) and
// outboxredis (Redis Streams). The outboxprom and outboxotel packages wrap
// any of them with metrics and traces.
//
// # Engines
//
// SQLite is the embedded default for development and tests; PostgreSQL is
// the production engine, where any number of dispatchers in any number of
// processes share one table through FOR UPDATE SKIP LOCKED. There a
// dispatcher's claims and settles commit without waiting for their WAL to
// be flushed: a crash of the server may forget the last of them, and their
// events are delivered again, which at-least-once delivery allows.
// MySQL 8.0+ and MariaDB 10.6+ are production engines too (tested on
// MariaDB): claims run under READ COMMITTED with SKIP LOCKED, and updates
// of emitting models lock and read their rows, since neither engine has
// UPDATE ... RETURNING. The engines' SQL of the delivery path and the
// migrator lives in internal/dialect, one file per engine, behind the one
// interface the write and delivery paths call.
//
// The package imports no database driver: a program links only the GORM
// driver it opens, so a PostgreSQL or MySQL program builds with
// CGO_ENABLED=0. SQLite works through gorm.io/driver/sqlite
// (mattn/go-sqlite3, cgo) and through the pure-Go github.com/glebarez/sqlite.
//
// # Around the core
//
// Package outboxinspect reads the table for people and tools (messages by
// filter, one message whole, activity, and a check of these promises on
// the live table); cmd/outboxctl and the outboxui dashboard are built on
// it. Broker publishers, metrics, traces and the inbox for consumers live
// in packages of their own, so that a program importing only this one
// builds none of their dependencies.
package outbox
