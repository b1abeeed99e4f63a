// Package outboxamqp publishes outbox batches to RabbitMQ (AMQP 0-9-1).
//
// # Model
//
// A [Publisher] owns one channel on the application's connection, in
// confirm mode. For a batch it publishes every [outbox.Message] to one
// exchange ([WithExchange]; default "amq.topic"), with a routing key of its
// choosing ([WithRoutingKey]; default the event type), mandatory and
// persistent, then waits for the broker's confirms of all of them or the
// end of the publish context. The exchanges, queues and bindings are the
// application's to declare.
//
// Each message is a CloudEvent in the binary content mode of the
// CloudEvents AMQP binding, carried as AMQP 0-9-1 headers: the body is the
// event's payload, byte for byte; the content-type property is
// datacontenttype, application/json; every other attribute is a string
// header with the "cloudEvents_" prefix:
//
//	cloudEvents_id                 event id
//	cloudEvents_source             WithSource, default "gorm-outbox"
//	cloudEvents_specversion        1.0
//	cloudEvents_type               event type
//	cloudEvents_time               occurred at, RFC 3339
//	cloudEvents_subject            aggregate type "/" aggregate id
//	cloudEvents_partitionkey       aggregate type "/" aggregate id
//	cloudEvents_aggregatetype      aggregate type
//	cloudEvents_aggregateid        aggregate id
//	cloudEvents_aggregatesequence  the event's sequence in its aggregate (an integer)
//
// and the properties MessageId (event id), Type (event type), Timestamp
// (occurred at, in seconds) and delivery mode 2 (persistent). The event's
// own headers are added unchanged under their own names (a traceparent
// written with the event reaches the consumer); where one has the name of
// a header above, the publisher's value wins.
//
// # Delivery and deduplication
//
// Delivery is at least once: a message is accepted only when the broker
// confirmed it and did not return it, and RabbitMQ does not deduplicate,
// so a message the dispatcher sends again (after a crash between the
// confirm and the settle, a retried batch, a message after a failed one of
// its aggregate) reaches the queues again with the same MessageId and
// cloudEvents_id: consumers drop duplicates by that id, or by keeping the
// highest cloudEvents_aggregatesequence applied per aggregate.
//
// Messages are published in batch order on one channel, so a queue gets
// each aggregate's messages in sequence order. When one fails, the later
// messages of its aggregate in the batch are reported as
// [outbox.ErrNotAttempted]: those not sent yet are not sent; those
// already confirmed stay in the queues and come again after the failed
// one, so a consumer can see event n+1 before n, and n+1 twice.
//
// # Errors
//
// Publish reports per-message outcomes in an [*outbox.PartialError].
// Permanent ([outbox.Permanent]): a message over the broker's
// max_message_size (PRECONDITION_FAILED), a publish refused for lack of
// permission (ACCESS_REFUSED), a routing key, event id, type or header
// name AMQP cannot carry. Retryable: a returned (unroutable) message
// ([ErrReturned]: no queue is bound for its routing key; it is never
// accepted, whatever its confirm says), a nack ([ErrNacked]), a missing
// exchange, a channel or connection closed, the end of the publish
// context. A channel the broker closed is replaced by a new one on the
// next batch; a connection is the application's: amqp091-go does not
// reconnect it, and while it is closed every batch fails with
// [amqp.ErrClosed] (retryable) until the application gives the dispatcher
// a publisher on a new connection. No publish outlives its context:
// messages not yet sent are reported as not attempted, those without a
// confirm as failed with the context's error, and the channel is
// replaced at the next batch so that their late confirms cannot be taken
// for another's. One limit comes from amqp091-go: a publish looks at its
// context before it writes, not while, so while RabbitMQ blocks the
// connection (a memory or disk alarm: see amqp.Connection.NotifyBlocked)
// a write can wait past the deadline.
package outboxamqp
