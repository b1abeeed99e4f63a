package outboxhttp

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/gorm-outbox/outbox"
)

// Outcome is what became of one message of a request, as a receiver reports
// it in a [Result].
type Outcome string

// The outcomes a receiver may report. [Handled] and [Duplicate] settle the
// message as delivered; [Failed] and [NotAttempted] do not.
const (
	// Handled: the receiver accepted the message now.
	Handled Outcome = "handled"
	// Duplicate: the receiver had accepted the message before; it counts
	// as accepted.
	Duplicate Outcome = "duplicate"
	// Failed: the receiver tried the message and could not accept it.
	// Result.Error says why; Result.Permanent says whether trying again can
	// help.
	Failed Outcome = "failed"
	// NotAttempted: the receiver did not try the message, for example
	// because an earlier message of its aggregate failed in the same
	// request. It is sent again without counting an attempt.
	NotAttempted Outcome = "not_attempted"
)

// Response is the body a receiver may answer a request with, as JSON, to
// settle each message of the request by what became of it:
//
//	{"batch_id": "...", "results": [
//	  {"event_id": "evt-1", "outcome": "handled"},
//	  {"event_id": "evt-2", "outcome": "failed", "error": "unknown product", "permanent": true},
//	  {"event_id": "evt-3", "outcome": "not_attempted"}]}
//
// BatchID is the request's batch_id (its Idempotency-Key), and Results holds
// one result per message of the request, in any order. A body whose
// batch_id is not the request's, or whose results is not an array, is not
// read as a Response: its status alone settles the request. inbox.Receiver
// answers with it; any receiver may. See the package documentation for how
// the [Publisher] reads it.
type Response struct {
	BatchID string   `json:"batch_id"`
	Results []Result `json:"results"`
}

// Result is what became of one message, in a [Response].
type Result struct {
	// EventID is the message's event_id.
	EventID string `json:"event_id"`
	// Outcome is what became of it.
	Outcome Outcome `json:"outcome"`
	// Error is why a failed or not-attempted message was not accepted, in
	// the receiver's words; the publisher records it as the message's
	// error. Empty otherwise.
	Error string `json:"error,omitempty"`
	// Permanent, for a failed message, says that retrying cannot help: the
	// message is dead-lettered at once. Otherwise the message is retried
	// with backoff.
	Permanent bool `json:"permanent,omitempty"`
}

// resultsLimit bounds how much of a JSON response is read for its results:
// 10,000 results with reasons of a few hundred bytes fit.
const resultsLimit = 8 << 20

// errInvalidResults is wrapped by the error of a request whose response has
// results that do not describe it.
var errInvalidResults = errors.New("invalid results")

// resultError is why a receiver's results say a message was not accepted.
type resultError struct {
	outcome    Outcome
	reason     string
	permanent  bool
	retryAfter time.Duration
}

// Error is the receiver's reason, as it gave it.
func (e *resultError) Error() string {
	if e.reason != "" {
		return e.reason
	}
	return "receiver reported " + string(e.outcome)
}

// Unwrap makes a not-attempted message [outbox.ErrNotAttempted] and a
// permanent failure [outbox.ErrPermanent].
func (e *resultError) Unwrap() error {
	switch {
	case e.outcome == NotAttempted:
		return outbox.ErrNotAttempted
	case e.permanent:
		return outbox.ErrPermanent
	}
	return nil
}

// RetryDelay is the response's Retry-After, so that a transient failure
// waits at least as long as the receiver asked (see outbox.RetryDelayer).
func (e *resultError) RetryDelay() time.Duration { return e.retryAfter }

// decodeResults reads body as a [Response] to the request batchID that
// carried msgs. It returns ok false when body is not such a document: not
// a JSON object, or one whose "batch_id" is not batchID or whose "results"
// is not an array, as a receiver that predates the results answers with a
// JSON body of its own. The status alone then settles the request. When
// body is one, it returns one error per message (nil for an accepted one),
// or an error wrapping errInvalidResults when the results do not describe
// the request: a result that cannot be read, a message without a result or
// with two, a result for no message of the request, or an unknown outcome.
func decodeResults(body []byte, batchID string, msgs []outbox.Message, retryAfter time.Duration) (errs []error, ok bool, err error) {
	var doc struct {
		BatchID string          `json:"batch_id"`
		Results json.RawMessage `json:"results"`
	}
	if json.Unmarshal(body, &doc) != nil || doc.BatchID != batchID || !isArray(doc.Results) {
		return nil, false, nil
	}
	var results []Result
	if err := json.Unmarshal(doc.Results, &results); err != nil {
		return nil, true, fmt.Errorf("%w: %v", errInvalidResults, err)
	}
	byID := make(map[string]error, len(results))
	for _, r := range results {
		if _, dup := byID[r.EventID]; dup {
			return nil, true, fmt.Errorf("%w: two results for event %q", errInvalidResults, r.EventID)
		}
		switch r.Outcome {
		case Handled, Duplicate:
			byID[r.EventID] = nil
		case Failed, NotAttempted:
			byID[r.EventID] = &resultError{outcome: r.Outcome, reason: r.Error, permanent: r.Permanent, retryAfter: retryAfter}
		default:
			return nil, true, fmt.Errorf("%w: event %q has unknown outcome %q", errInvalidResults, r.EventID, r.Outcome)
		}
	}
	errs = make([]error, len(msgs))
	seen := make(map[string]bool, len(msgs))
	for i, m := range msgs {
		e, found := byID[m.EventID]
		if !found {
			return nil, true, fmt.Errorf("%w: no result for event %q", errInvalidResults, m.EventID)
		}
		errs[i] = e
		seen[m.EventID] = true
	}
	if len(seen) != len(byID) {
		for id := range byID {
			if !seen[id] {
				return nil, true, fmt.Errorf("%w: result for event %q, which the request did not carry", errInvalidResults, id)
			}
		}
	}
	return errs, true, nil
}

// isArray reports whether v, a JSON value, is an array.
func isArray(v json.RawMessage) bool {
	v = bytes.TrimLeft(v, " \t\r\n")
	return len(v) > 0 && v[0] == '['
}
