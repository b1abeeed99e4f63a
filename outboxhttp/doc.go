// Package outboxhttp delivers outbox batches to an HTTP endpoint, and helps
// the receiving service check what it got.
//
// # What is sent
//
// For every [outbox.Batch], a [Publisher] makes one POST request to the
// configured URL. The body is the batch as JSON:
//
//	{"batch_id": "...", "messages": [{"event_id": "...", "event_type": "...",
//	  "aggregate_type": "...", "aggregate_id": "...", "sequence": 1,
//	  "idempotency_key": "...", "payload": {...}, "headers": {...},
//	  "occurred_at": "...", "attempt": 1}, ...]}
//
// Each payload arrives as the same JSON document that was stored, re-encoded
// without insignificant whitespace (the bytes may differ, the value does not).
// The request carries these headers:
//
//	Content-Type: application/json
//	Idempotency-Key: <batch_id>
//	Outbox-Batch-Size: <number of messages>
//	Outbox-Signature: sha256=<hex HMAC-SHA256 of the body>  (only with WithSecret)
//
// # What the response means
//
// A 2xx response means the receiver accepted every message of the batch. 408,
// 429 and 5xx responses, network errors and timeouts are retryable: the
// dispatcher sends the batch again later. Any other status (other 4xx, an
// unfollowed 3xx) is permanent: the whole batch is dead-lettered at once.
// Failures are reported as a [*StatusError] (wrapped; use errors.As) when the
// receiver answered.
//
// # Receiving
//
// Delivery is at least once: the same batch, or the same message in a later
// batch, can arrive more than once. A receiver should
//
//   - read and check the request with [DecodeRequest], which bounds the body
//     size, verifies the signature with [Verify] when a secret is shared, and
//     checks that Idempotency-Key equals batch_id;
//   - deduplicate on each message's event_id (or idempotency_key), since a
//     retried message travels in a new batch with a new batch_id; batch_id
//     only identifies one delivery attempt;
//   - answer 2xx only after the messages are durably accepted, and answer 2xx
//     again for a duplicate it has already accepted;
//   - answer 5xx (or 429 with Retry-After) for a failure worth retrying, and
//     another 4xx only for a batch that can never be accepted, since such a
//     batch is dead-lettered.
//
// Within one aggregate, messages arrive in sequence order and sequence n+1 is
// never sent before sequence n was accepted, so a receiver can also detect
// duplicates by remembering the highest sequence it applied per aggregate.
package outboxhttp
