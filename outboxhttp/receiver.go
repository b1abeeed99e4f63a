package outboxhttp

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"

	"github.com/gorm-outbox/outbox"
)

// DefaultMaxBytes is the body limit [DecodeRequest] applies when given a
// non-positive maxBytes, and the default of [WithMaxBodyBytes]: 2 MiB,
// twice [outbox.DefaultMaxPayloadBytes], so that at the defaults every
// event the outbox accepts fits a request, with its envelope and headers.
const DefaultMaxBytes = 2 << 20

var (
	// ErrBadSignature is returned by [DecodeRequest] when a secret is
	// configured and the [HeaderSignature] header is missing, malformed or
	// does not match the body. A receiver should answer 401.
	ErrBadSignature = errors.New("outboxhttp: bad signature")

	// ErrTooLarge is returned by [DecodeRequest] when the body exceeds the
	// limit; a receiver should answer 413. A [Publisher] reports it
	// (wrapped, permanent, naming the size) for a message too large to send
	// in a request of its own, or that the receiver answered 413 alone.
	ErrTooLarge = errors.New("outboxhttp: request body too large")

	// ErrMalformed is returned (wrapped, with the reason) by [DecodeRequest]
	// for a request that is not a well-formed batch: wrong method or content
	// type, invalid JSON, a missing batch or event ID, or headers that
	// disagree with the body. A receiver should answer 400.
	ErrMalformed = errors.New("outboxhttp: malformed request")
)

// Verify reports whether signatureHeader is the [HeaderSignature] value a
// publisher with secret sends for body: "sha256=" followed by the hex
// HMAC-SHA256 of body. The comparison takes constant time in the contents.
// Verify returns false for an empty secret and for a header that is missing
// or malformed.
func Verify(secret, body []byte, signatureHeader string) bool {
	if len(secret) == 0 {
		return false
	}
	hexDigest, ok := strings.CutPrefix(signatureHeader, signaturePrefix)
	if !ok {
		return false
	}
	got, err := hex.DecodeString(hexDigest)
	if err != nil || len(got) != sha256.Size {
		return false
	}
	return hmac.Equal(got, digest(secret, body))
}

// DecodeRequest reads a batch sent by a [Publisher] from r, checking it on
// the way, and returns it only when every check passed:
//
//   - the body is at most maxBytes long ([DefaultMaxBytes] if maxBytes <= 0),
//     else [ErrTooLarge]; no more than maxBytes+1 bytes are read;
//   - when secret is non-empty, [HeaderSignature] matches the body (see
//     [Verify]), else [ErrBadSignature]; this is checked before the body is
//     parsed;
//   - the method is POST, the content type is application/json, the body is
//     one JSON batch with a non-empty batch_id equal to the Idempotency-Key
//     header, every message has an event_id, and Outbox-Batch-Size, when
//     present, equals the number of messages; else an error wrapping
//     [ErrMalformed].
//
// DecodeRequest does not close r.Body; the server does.
func DecodeRequest(r *http.Request, secret []byte, maxBytes int64) (outbox.Batch, error) {
	if maxBytes <= 0 {
		maxBytes = DefaultMaxBytes
	}
	if r.Method != http.MethodPost {
		return outbox.Batch{}, malformed("method %s, want POST", r.Method)
	}
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
		return outbox.Batch{}, malformed("content type %q, want application/json", r.Header.Get("Content-Type"))
	}

	if r.ContentLength > maxBytes {
		return outbox.Batch{}, fmt.Errorf("%w: %d bytes, limit %d", ErrTooLarge, r.ContentLength, maxBytes)
	}
	var body []byte
	if r.Body != nil {
		var err error
		body, err = io.ReadAll(io.LimitReader(r.Body, maxBytes+1))
		if err != nil {
			return outbox.Batch{}, fmt.Errorf("outboxhttp: read body: %w", err)
		}
	}
	if int64(len(body)) > maxBytes {
		return outbox.Batch{}, fmt.Errorf("%w: more than %d bytes", ErrTooLarge, maxBytes)
	}

	if len(secret) > 0 && !Verify(secret, body, r.Header.Get(HeaderSignature)) {
		return outbox.Batch{}, ErrBadSignature
	}

	var b outbox.Batch
	if err := json.Unmarshal(body, &b); err != nil {
		return outbox.Batch{}, malformed("body: %v", err)
	}
	if b.ID == "" {
		return outbox.Batch{}, malformed("batch_id is empty")
	}
	if key := r.Header.Get(HeaderIdempotencyKey); key != b.ID {
		return outbox.Batch{}, malformed("%s %q does not match batch_id %q", HeaderIdempotencyKey, key, b.ID)
	}
	if size := r.Header.Get(HeaderBatchSize); size != "" {
		if n, err := strconv.Atoi(size); err != nil || n != len(b.Messages) {
			return outbox.Batch{}, malformed("%s %q does not match %d messages", HeaderBatchSize, size, len(b.Messages))
		}
	}
	for i, m := range b.Messages {
		if m.EventID == "" {
			return outbox.Batch{}, malformed("message %d has no event_id", i)
		}
	}
	return b, nil
}

func malformed(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrMalformed, fmt.Sprintf(format, args...))
}
