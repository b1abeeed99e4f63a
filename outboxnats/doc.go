// Package outboxnats publishes outbox batches to NATS JetStream.
//
// # Model
//
// A [Publisher] turns every [outbox.Message] of a batch into one NATS
// message on a subject of its choosing ([WithSubject]; default
// "outbox.<event type>"), sends all of them asynchronously on the
// JetStream context's connection, then waits for every PubAck or the end
// of the publish context. A stream bound to the subjects stores them; the
// streams are the application's to create.
//
// Each message is a CloudEvent in the binary content mode of the
// CloudEvents NATS binding: the body is the event's payload, byte for
// byte, and the attributes are headers with the "ce-" prefix, their values
// percent-encoded as the binding requires (space, double quote, percent
// and every non-ASCII byte as %XY):
//
//	ce-id                 event id
//	ce-source             WithSource, default "gorm-outbox"
//	ce-specversion        1.0
//	ce-type               event type
//	ce-time               occurred at, RFC 3339
//	ce-subject            aggregate type "/" aggregate id
//	ce-datacontenttype    application/json
//	ce-partitionkey       aggregate type "/" aggregate id
//	ce-aggregatetype      aggregate type
//	ce-aggregateid        aggregate id
//	ce-aggregatesequence  the event's sequence in its aggregate (an integer)
//	Nats-Msg-Id           event id, for the stream's duplicate window
//
// The event's own headers are added unchanged, under their own names (a
// traceparent written with the event reaches the consumer); where one has
// the name of a header above, the publisher's value wins. A header NATS
// cannot carry (an empty name, a name with white space or ':', a value
// with CR or LF) fails its message permanently.
//
// # Delivery and deduplication
//
// Delivery is at least once; within the stream's duplicate window
// (StreamConfig.Duplicates, two minutes by default) it is exactly once in
// the stream: a message published again, because a dispatcher died
// between the PubAck and its settle or a batch was retried, carries the
// same Nats-Msg-Id, the stream drops it, and the PubAck that says
// "duplicate" counts as accepted. Past the window a redelivery is stored
// again: consumers deduplicate on ce-id. Make the window longer than the
// dispatcher's lease plus its retry backoff to cover every redelivery the
// dispatcher makes.
//
// The messages of one aggregate are published in sequence order on one
// connection without the client's own retries, so the stream stores them
// in that order as long as none fails. When one fails, the later messages
// of its aggregate in the batch are reported as [outbox.ErrNotAttempted];
// those already sent and stored stay stored (the stream drops their copy
// when they are sent again after the failed one, within the window), so
// the stream can hold an aggregate's event n+1 before a failed event n,
// or without it when n is dead-lettered. ce-aggregatesequence tells a
// consumer which.
//
// # Errors
//
// Publish reports per-message outcomes in an [*outbox.PartialError].
// Permanent ([outbox.Permanent]): a message over the connection's
// max_payload or the stream's max_msg_size, an invalid subject, a header
// NATS cannot carry, and a publish the server refused for lack of
// permission. NATS reports a refusal on the connection, not in a reply:
// the message waits for its ack until the publish context ends, and is
// then failed permanently when the connection's last error is a
// permissions violation naming its subject (it wraps
// nats.ErrPermissionViolation). Retryable: no stream bound to the
// subject, a closed or reconnecting connection, an ack timeout, and the
// end of the publish context. nats.go reconnects by itself; a connection
// closed with Close cannot be re-opened, and every batch then fails
// until the application gives the dispatcher a publisher on a new one.
// No publish outlives its context: messages not yet sent are reported
// as not attempted, those without an ack as failed with the context's
// error. An ack that never comes (a refused publish) stays pending in the
// JetStream context until its own timeout: create it with
// jetstream.WithPublishAsyncTimeout so that such acks are dropped and
// never fill its window of pending acks (jetstream.WithPublishAsyncMaxPending,
// 4,000 by default; a publish waits for room until the deadline).
package outboxnats
