// Package outboxkafka delivers outbox batches to Apache Kafka through a
// franz-go client (github.com/twmb/franz-go/pkg/kgo).
//
// # Setup
//
//	cl, err := kgo.NewClient(kgo.SeedBrokers("kafka:9092")) // franz-go's default producer
//	pub, err := outboxkafka.New(cl, outboxkafka.WithSource("https://shop.example/orders"))
//	d, err := outbox.NewDispatcher(db, pub)
//	go d.Run(ctx) // events of aggregate type "order" go to the topic "outbox.order"
//	// consumers read CloudEvents (binary mode) and deduplicate on ce_id
//
// Every committed event reaches Kafka at least once and none of a
// rolled-back transaction ever does; an aggregate's events arrive in its
// partition in sequence order, save the early copy that a failure can
// leave (see Batches and acknowledgements).
//
// # The model
//
// A [Publisher] produces each message of a batch as one Kafka record: to
// the topic that [WithTopic] picks (by default "outbox." followed by the
// aggregate type), with the aggregate key "type/id" as the record key. The
// client's partitioner hashes the key, so that one aggregate stays in one
// partition; the dispatcher hands out an aggregate's events in sequence
// order and franz-go's idempotent producer keeps that order within a
// partition, across its own retries. A consumer therefore reads each
// aggregate's events in sequence order, per partition.
//
// # What a record carries
//
// The value is the event's payload, byte for byte. The metadata follows the
// binary content mode of the CloudEvents Kafka protocol binding, so that a
// CloudEvents SDK reads the record as the event it is:
//
//	ce_id                 event ID
//	ce_source             WithSource, default "gorm-outbox"
//	ce_specversion        1.0
//	ce_type               event type
//	ce_time               occurred at, RFC 3339
//	ce_subject            aggregate key, "order/42"
//	content-type          application/json (the binding's datacontenttype)
//	ce_partitionkey       aggregate key (Partitioning extension)
//	ce_aggregatetype      aggregate type
//	ce_aggregateid        aggregate ID
//	ce_aggregatesequence  the event's sequence in its aggregate, 1, 2, 3, ...
//
// The event's own headers follow unchanged, under their own names (a
// traceparent written with the event reaches the consumer as traceparent).
// An event header named like one of the headers above cannot be sent
// without changing the event: that message fails with [ErrReservedHeader].
// The CloudEvents sequence extension is not used: its values must sort as
// strings within one source, which per-aggregate numbers do not.
//
// # Batches and acknowledgements
//
// Publish produces the whole batch asynchronously and then waits for every
// acknowledgement, or for the end of its context, whichever is first: no
// Publish outlives the dispatcher's publish timeout. Give the client
// franz-go's default producer: idempotent writes, acks from all in-sync
// replicas, no transactional ID (New refuses a transactional client).
//
// A message that fails is reported alone in an [*outbox.PartialError], and
// every later message of its aggregate in the batch is reported
// [outbox.ErrNotAttempted], so the dispatcher offers them again only after
// the failed one. A message refused before it is produced (too large, bad
// topic, reserved header) keeps the later ones of its aggregate from being
// produced at all. A failure that Kafka reports asynchronously can come
// after franz-go has already sent a later record of the same aggregate,
// which Kafka may then keep: the consumer sees sequence n+1 before n, and
// n+1 again after n. A consumer that needs strict order applies an
// aggregate's ce_aggregatesequence n+1 only right after n and skips any
// other; the skipped record arrives again in its place.
//
// # Errors
//
// Permanent ([outbox.Permanent]; the message is dead-lettered at once):
// a record larger than the client's ProducerBatchMaxBytes (checked before
// it is produced; keep that option at or below the topics'
// max.message.bytes) or than the broker accepts (kerr.MessageTooLarge,
// kerr.RecordListTooLarge), an invalid topic name (kerr.InvalidTopicException,
// also checked before producing), authorization refused
// (kerr.TopicAuthorizationFailed, kerr.ClusterAuthorizationFailed,
// kerr.SaslAuthenticationFailed), kerr.InvalidRecord,
// kerr.PolicyViolation and kerr.UnsupportedForMessageFormat, and
// [ErrReservedHeader]. The broker refuses a record batch whole: when it
// finds several records too large, Publish produces them again one at a
// time, so that only the record at fault is dead-lettered.
//
// Retryable (the message is retried with backoff): everything else, in
// particular timeouts and the end of the context, brokers unreachable or
// not leader, not enough replicas, a topic that does not exist (yet), and
// the record retry limit. franz-go reconnects by itself; a record still
// unacknowledged when the context ends is reported with the context's
// error, may still be written, and is delivered again.
//
// # Duplicates
//
// Delivery is at least once. The idempotent producer drops only the
// duplicates of franz-go's own retries within one producer session; an
// event the dispatcher publishes again (after a timeout, a failed batch, a
// crash of the dispatcher) is a new record to Kafka. Consumers deduplicate
// on ce_id, or keep the highest ce_aggregatesequence applied per
// ce_partitionkey and skip anything at or below it.
package outboxkafka
