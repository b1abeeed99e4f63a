// Package outboxredis delivers outbox batches to Redis Streams through a
// go-redis client (github.com/redis/go-redis/v9).
//
// # Setup
//
//	rdb := redis.NewClient(&redis.Options{Addr: "redis:6379", ContextTimeoutEnabled: true})
//	pub, err := outboxredis.New(rdb, outboxredis.WithSource("https://shop.example/orders"))
//	d, err := outbox.NewDispatcher(db, pub)
//	go d.Run(ctx) // events of aggregate type "order" go to the stream "outbox:order"
//	// consumers XREADGROUP the stream and deduplicate on the id field (below Redis 8.6)
//
// Every committed event is appended at least once and none of a
// rolled-back transaction ever is; an aggregate's events are appended to
// its stream in sequence order, save the early copy that a failure can
// leave (see Batches and replies).
//
// # The model
//
// A [Publisher] appends each message of a batch as one stream entry with
// XADD, to the stream key that [WithStream] picks (by default "outbox:"
// followed by the aggregate type). A batch goes out as one pipeline, which
// Redis runs in order, so that a stream holds each aggregate's events in
// sequence order: a consumer (XREAD, or a consumer group with XREADGROUP)
// reads them in that order per stream.
//
// # What an entry carries
//
// Its fields are named after the CloudEvents attributes, as a binary-mode
// event with no prefix, then the event's own headers, then the payload:
//
//	id                 event ID
//	source             WithSource, default "gorm-outbox"
//	specversion        1.0
//	type               event type
//	time               occurred at, RFC 3339
//	subject            aggregate key, "order/42"
//	datacontenttype    application/json
//	partitionkey       aggregate key (Partitioning extension)
//	aggregatetype      aggregate type
//	aggregateid        aggregate ID
//	aggregatesequence  the event's sequence in its aggregate, 1, 2, 3, ...
//	header.<name>      each of the event's own headers, value unchanged
//	data               the payload, byte for byte
//
// The header. prefix keeps a header from colliding with an attribute: a
// traceparent written with the event is the field header.traceparent. The
// CloudEvents sequence extension is not used: its values must sort as
// strings within one source, which per-aggregate numbers do not.
//
// # Batches and replies
//
// Publish sends the whole batch in one pipeline and waits for the replies,
// or for the end of its context, whichever is first: no Publish outlives
// the dispatcher's publish timeout. Create the client with
// ContextTimeoutEnabled so that its connections honour that deadline too.
// [WithMaxLen] caps each stream (MAXLEN ~ n); it is off by default.
//
// A message that fails is reported alone in an [*outbox.PartialError], and
// every later message of its aggregate in the batch is reported
// [outbox.ErrNotAttempted], so the dispatcher offers them again only after
// the failed one. A message refused before it is sent (too large, empty
// key) keeps the later ones of its aggregate out of the pipeline. Redis
// runs the rest of a pipeline after a failed command, so where a failure
// hits one command and not the next of the same stream (out of memory, a
// lost connection) the stream can hold sequence n+1 before n, and n+1
// again after n. A consumer that needs strict order applies an aggregate's
// aggregatesequence n+1 only right after n and skips any other entry; the
// skipped event arrives again in its place.
//
// # Errors
//
// Permanent ([outbox.Permanent]; the message is dead-lettered at once): a
// payload or header longer than the server's proto-max-bulk-len (checked
// before sending, [ErrTooLarge]), an empty stream key, a key that holds
// another type (WRONGTYPE), and authorization refused (NOPERM, NOAUTH,
// WRONGPASS).
//
// Retryable (the message is retried with backoff): everything else, in
// particular timeouts and the end of the context, an unreachable server or
// a closed connection (go-redis dials again on the next batch), OOM,
// READONLY, LOADING and cluster redirections it could not follow. A
// command without a reply when the context ends is reported with the
// context's error; Redis may have run it, and it is delivered again.
//
// # Duplicates
//
// Delivery is at least once. On Redis 8.6 and later, whose XADD takes IDMP,
// the publisher adds each entry with the source as producer ID and the
// event ID as idempotent ID, so that an event published again while Redis
// remembers its ID is stored once; Redis remembers the last 100 IDs per
// producer for 100 seconds by default, which XCFGSET (IDMP-DURATION,
// IDMP-MAXSIZE) widens, up to a day and 10,000 IDs. [Publisher.Idempotent]
// says which case a server is. Older servers (7.x has no IDMP) store every
// copy: a consumer deduplicates on the id field, or keeps the highest
// aggregatesequence applied per subject and skips anything at or below it.
package outboxredis
