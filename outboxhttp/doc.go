// Package outboxhttp delivers outbox batches to an HTTP endpoint, and helps
// the receiving service check what it got.
//
// # What is sent
//
// For every [outbox.Batch], a [Publisher] makes a POST request to the
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
// A body is at most [WithMaxBodyBytes] long (2 MiB by default, the
// receiving side's default limit). A larger batch is sent in several
// requests, one after the other, in the batch's order; the first carries
// the batch's id as its batch_id, the n-th (n >= 2) carries
// "<batch id>.<n>", so that every request has an Idempotency-Key of its own.
// A message that does not fit in a request of its own is not sent: it
// fails alone, permanently, with an error that wraps [ErrTooLarge] and
// names its size. When the receiver answers 413 to a request of several
// messages, the publisher sends each half of it again, until the message
// too large for the receiver is alone; it fails the same way.
//
// Within one aggregate, messages are sent in sequence order, and once one
// is not accepted, the later ones of its aggregate are not sent (they are
// retried later, without counting an attempt).
//
// # What the response means
//
// A receiver says what became of each message by answering with a JSON
// [Response] (Content-Type application/json), whatever its status:
//
//	{"batch_id": "<the request's batch_id>", "results": [
//	  {"event_id": "evt-1", "outcome": "handled"},
//	  {"event_id": "evt-2", "outcome": "duplicate"},
//	  {"event_id": "evt-3", "outcome": "failed", "error": "unknown product", "permanent": true},
//	  {"event_id": "evt-4", "outcome": "not_attempted"},
//	  {"event_id": "evt-5", "outcome": "failed", "error": "stock service down"}]}
//
// There is one result per message of the request, in any order. "handled"
// and "duplicate" messages are delivered. A "failed" one is dead-lettered
// at once when "permanent" is true, and retried with backoff otherwise (no
// sooner than the response's Retry-After); either way its "error" is
// recorded as the message's error. A "not_attempted" one is sent again
// later without counting an attempt: a receiver reports it for a message
// it did not try because an earlier one of the same aggregate failed, and
// must not accept a message after a failed one of its aggregate. The
// publisher reports these outcomes to the dispatcher as an
// [*outbox.PartialError]. inbox.Receiver answers this way.
//
// A body is read as results only when it is a JSON object whose
// "batch_id" is the request's and whose "results" is an array. A results
// document that names the request but does not describe it (a message
// without a result or with two, a result for another message, a result
// that cannot be read, an unknown outcome) fails the request as a whole,
// to be retried.
//
// A response without results (any other body, JSON or not, such as the
// {"status":"ok","results":[]} of a receiver that predates results) is
// settled by its status alone, for every message of the request: 2xx means
// the receiver accepted them all. 408, 429 and 5xx responses, network errors and timeouts are
// retryable: the dispatcher sends them again later, no sooner than
// Retry-After. 413 makes the publisher split the request, as above. Any
// other status (other 4xx, an unfollowed 3xx) is permanent: the messages
// are dead-lettered at once. These failures are reported as a
// [*StatusError] (wrapped; use errors.As). After a request that fails as a
// whole, the publisher sends none of the batch's later requests: their
// messages, of whatever aggregate, are sent again later without counting
// an attempt, and only the failed request's own messages take its error.
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
//   - answer only after the messages it reports accepted are durably
//     accepted, and report a duplicate it has already accepted as accepted;
//   - answer a [Response] when it handles messages one by one, so that one
//     message it refuses does not hold back the others; or a status for the
//     whole request: 2xx, 5xx (or 429 with Retry-After) for a failure worth
//     retrying, and another 4xx only for a request that can never be
//     accepted, since its messages are dead-lettered.
//
// Within one aggregate, messages arrive in sequence order and sequence n+1 is
// never sent before sequence n was accepted, so a receiver can also detect
// duplicates by remembering the highest sequence it applied per aggregate.
package outboxhttp
