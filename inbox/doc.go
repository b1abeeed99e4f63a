// Package inbox makes a consumer of outbox events apply each event once.
//
// The outbox delivers every committed event at least once: after a crash,
// a timeout or a lost acknowledgement, the same event arrives again,
// possibly while its first delivery is still being applied. The inbox is
// the outbox's mirror image on the consumer's side: the consumer records
// the event's id in the same database transaction as its own writes, so
// the writes and the record commit together or not at all, and a second
// delivery finds the record and skips the event.
//
//	in, err := inbox.New(db, inbox.WithTable("inbox_records"))
//	err = in.Migrate(ctx)
//	handled, err := in.Handle(ctx, msg.EventID, func(tx *gorm.DB) error {
//		return tx.Create(&Shipment{OrderID: orderID}).Error
//	})
//
// [Inbox.Handle] inserts the id first and then runs fn in the same
// transaction. An id already recorded means the event was applied: fn is
// not called and Handle reports handled == false with no error. An error
// from fn rolls everything back, the id included, so that a later delivery
// applies the event again. Two deliveries of one id at the same time are
// serialised by the database (the primary key on PostgreSQL and MySQL, the
// write lock on SQLite): the second waits for the first to commit and then
// skips, or, if the first rolled back, applies the event itself.
//
// Events that fn publishes through the outbox plugin registered on the
// consumer's db commit with its writes and with the inbox row, so a
// service that consumes and produces is effectively-once end to end.
//
// Each row keeps when it was handled, and for [Inbox.HandleMessage] the
// event's type. [Inbox.Cleanup] forgets ids older than an age, in bounded
// batches; an event delivered again after its id was forgotten is applied
// again, so keep ids for longer than any redelivery can be late.
//
// # Batches and HTTP
//
// [Inbox.HandleBatch] applies an [outbox.Batch] message by message and
// reports each one's [Outcome], keeping each aggregate's order: after a
// failure, the rest of that aggregate's messages in the batch are not
// attempted. [Receiver] is an http.Handler for the batches that the
// outboxhttp publisher posts: it checks the request with
// outboxhttp.DecodeRequest, handles the batch, and answers with the
// per-message outcomes as JSON (an outboxhttp.Response), by which the
// publisher settles each message: one the consumer refuses holds back
// only its own aggregate.
//
// # Engines
//
// SQLite, PostgreSQL and MySQL/MariaDB (gorm.io/driver/mysql). On SQLite,
// open the database as the outbox recommends, with a busy timeout so that
// concurrent deliveries queue instead of failing:
// file:app.db?_busy_timeout=5000&_journal_mode=WAL&_txlock=immediate. On
// PostgreSQL, Handle's transaction must run at READ COMMITTED (the
// default). [Inbox.Migrate] is versioned and safe to run from many
// processes at once.
package inbox
