package inbox

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

// Receiver is an http.Handler that takes the batches an
// [outboxhttp.Publisher] posts and applies each message once through an
// [Inbox]. Create one with [NewReceiver]; it is safe for concurrent use.
//
// For each request it checks the batch with [outboxhttp.DecodeRequest],
// handles its messages with [Inbox.HandleBatch], and answers with a JSON
// [Response], the outboxhttp.Response of the outboxhttp protocol: every
// message's outcome, with the reason of a failure and whether it is
// permanent (apply returned an error marked with [outbox.Permanent], or
// the message failed with [ErrInvalidMessage]). The outboxhttp publisher
// settles each message by it: the applied and duplicate ones are
// delivered, a permanent failure is dead-lettered alone with its reason,
// another failure is retried alone, and the messages not attempted come
// back later. The status says what the batch as a whole needs, for a
// client that reads only the status:
//
//   - 200 when every message was handled or was a duplicate;
//   - 422 when no message was applied, now or before, and every failure
//     was permanent: retrying cannot help;
//   - 503 otherwise (some message failed, or was not attempted): the
//     messages that were applied come back as duplicates if the batch is
//     sent again;
//   - 400, 401 and 413 for a request that DecodeRequest refuses as
//     malformed, badly signed or too large, and 503 when the body cannot
//     be read; these answers are plain text, and the status settles the
//     request.
type Receiver struct {
	in       *Inbox
	apply    ApplyFunc
	secret   []byte
	maxBytes int64
	log      *slog.Logger
}

// Response is the body of every answer of a [Receiver] to a batch it
// decoded: the batch's id and one result per message, in the batch's
// order. Its JSON is an outboxhttp.Response (see [Result.MarshalJSON]).
type Response struct {
	BatchID string   `json:"batch_id"`
	Results []Result `json:"results"`
}

// ReceiverOption configures a [Receiver]. An option given an invalid value
// makes [NewReceiver] fail with an error that wraps
// [outbox.ErrInvalidOption] and names the option.
type ReceiverOption func(*Receiver) error

// WithSecret makes the receiver accept only requests signed with secret
// (the publisher's outboxhttp.WithSecret) and answer 401 to others. The
// secret is copied and must not be empty.
//
// Default: no signature is checked.
func WithSecret(secret []byte) ReceiverOption {
	return func(r *Receiver) error {
		if len(secret) == 0 {
			return fmt.Errorf("%w: WithSecret: secret is empty", outbox.ErrInvalidOption)
		}
		r.secret = bytes.Clone(secret)
		return nil
	}
}

// WithMaxBytes bounds the request body; a longer one is answered 413. n
// must be positive.
//
// Default: [outboxhttp.DefaultMaxBytes] (2 MiB).
func WithMaxBytes(n int64) ReceiverOption {
	return func(r *Receiver) error {
		if n <= 0 {
			return fmt.Errorf("%w: WithMaxBytes: %d is not positive", outbox.ErrInvalidOption, n)
		}
		r.maxBytes = n
		return nil
	}
}

// WithLogger sets the logger the receiver reports refused requests and
// failed messages to. l must not be nil.
//
// Default: [slog.Default].
func WithLogger(l *slog.Logger) ReceiverOption {
	return func(r *Receiver) error {
		if l == nil {
			return fmt.Errorf("%w: WithLogger: logger is nil", outbox.ErrInvalidOption)
		}
		r.log = l
		return nil
	}
}

// NewReceiver returns a receiver that applies each message of a batch with
// apply, through in. in and apply must not be nil.
func NewReceiver(in *Inbox, apply ApplyFunc, opts ...ReceiverOption) (*Receiver, error) {
	if in == nil {
		return nil, fmt.Errorf("%w: NewReceiver: nil *Inbox", outbox.ErrInvalidOption)
	}
	if apply == nil {
		return nil, fmt.Errorf("%w: NewReceiver: nil ApplyFunc", outbox.ErrInvalidOption)
	}
	r := &Receiver{in: in, apply: apply, maxBytes: outboxhttp.DefaultMaxBytes, log: slog.Default()}
	for _, opt := range opts {
		if err := opt(r); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// ServeHTTP decodes, handles and answers one batch; see [Receiver].
func (r *Receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	b, err := outboxhttp.DecodeRequest(req, r.secret, r.maxBytes)
	if err != nil {
		status := http.StatusServiceUnavailable
		switch {
		case errors.Is(err, outboxhttp.ErrBadSignature):
			status = http.StatusUnauthorized
		case errors.Is(err, outboxhttp.ErrTooLarge):
			status = http.StatusRequestEntityTooLarge
		case errors.Is(err, outboxhttp.ErrMalformed):
			status = http.StatusBadRequest
		}
		r.log.WarnContext(req.Context(), "inbox: refused a batch", "status", status, "error", err)
		http.Error(w, err.Error(), status)
		return
	}

	results := r.in.HandleBatch(req.Context(), b, r.apply)
	status := batchStatus(req.Context(), results)
	for _, res := range results {
		if res.Outcome == Failed {
			r.log.WarnContext(req.Context(), "inbox: message failed", "batch_id", b.ID, "event_id", res.EventID, "error", res.Err)
		}
	}
	body, err := json.Marshal(Response{BatchID: b.ID, Results: results})
	if err != nil {
		// Results hold only strings: this cannot fail.
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// MarshalJSON encodes r as an outboxhttp.Result: its event id and outcome,
// and for a failed or not-attempted message Err's text as "error", with
// "permanent" true when Err is marked with [outbox.Permanent] or wraps
// [ErrInvalidMessage].
func (r Result) MarshalJSON() ([]byte, error) {
	w := outboxhttp.Result{EventID: r.EventID, Outcome: outboxhttp.Outcome(r.Outcome)}
	if r.Err != nil && r.Outcome != Handled && r.Outcome != Duplicate {
		w.Error = r.Err.Error()
		w.Permanent = r.Outcome == Failed && permanent(r.Err)
	}
	return json.Marshal(w)
}

// permanent reports whether retrying the message that failed with err
// cannot help.
func permanent(err error) bool {
	return outbox.IsPermanent(err) || errors.Is(err, ErrInvalidMessage)
}

// batchStatus is the status that tells a client reading only the status
// what the batch as a whole needs.
func batchStatus(ctx context.Context, results []Result) int {
	applied, failed, transient := 0, 0, 0
	for _, res := range results {
		switch res.Outcome {
		case Handled, Duplicate:
			applied++
		case Failed:
			failed++
			if !permanent(res.Err) {
				transient++
			}
		}
	}
	switch {
	case applied == len(results):
		return http.StatusOK
	case applied == 0 && failed > 0 && transient == 0 && ctx.Err() == nil:
		// The others were not attempted behind a permanent failure of
		// their aggregate.
		return http.StatusUnprocessableEntity
	}
	return http.StatusServiceUnavailable
}
