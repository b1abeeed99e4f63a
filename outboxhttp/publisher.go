package outboxhttp

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox"
)

// Header names used on the wire.
const (
	// HeaderIdempotencyKey carries the batch ID.
	HeaderIdempotencyKey = "Idempotency-Key"
	// HeaderBatchSize carries the number of messages in the batch, in decimal.
	HeaderBatchSize = "Outbox-Batch-Size"
	// HeaderSignature carries "sha256=" followed by the lowercase hex
	// HMAC-SHA256 of the request body, keyed with the shared secret. It is
	// sent only when the publisher has a secret (see [WithSecret]).
	HeaderSignature = "Outbox-Signature"
)

// DefaultTimeout bounds each request when [WithTimeout] is not given.
const DefaultTimeout = 10 * time.Second

// DefaultUserAgent is the User-Agent sent when [WithUserAgent] is not given.
const DefaultUserAgent = "gorm-outbox-outboxhttp"

const (
	// errorBodyLimit is how much of an error response is kept in StatusError.
	errorBodyLimit = 512
	// drainLimit is how much of a response is read before closing it, so the
	// connection can be reused; a longer body just closes the connection.
	drainLimit = 64 << 10
	// signaturePrefix precedes the hex digest in HeaderSignature.
	signaturePrefix = "sha256="
)

// Publisher posts each batch to one HTTP endpoint. It implements
// [outbox.Publisher] and is safe for concurrent use.
type Publisher struct {
	url       string // as given to New
	redacted  string // url with any password masked, for error messages
	client    *http.Client
	timeout   time.Duration
	secret    []byte
	header    http.Header
	userAgent string
}

var _ outbox.Publisher = (*Publisher)(nil)

// Option configures a [Publisher]. An option given an out-of-range value makes
// [New] fail with an error that wraps [outbox.ErrInvalidOption] and names the
// option.
type Option func(*config) error

type config struct {
	client    *http.Client
	timeout   time.Duration
	secret    []byte
	header    http.Header
	userAgent string
}

// WithClient makes the publisher send its requests through c, including c's
// transport, redirect policy and timeout. c must not be nil.
//
// Default: a client of the publisher's own (not [http.DefaultClient]), with a
// private connection pool, that follows only 307 and 308 redirects, which
// resend the POST with its body. Any other redirect is returned as a
// permanent failure rather than followed, because following it would turn
// the POST into a GET and lose the batch.
func WithClient(c *http.Client) Option {
	return func(cfg *config) error {
		if c == nil {
			return fmt.Errorf("%w: WithClient: client is nil", outbox.ErrInvalidOption)
		}
		cfg.client = c
		return nil
	}
}

// WithTimeout bounds each request, from sending it to reading the response
// headers and a bounded part of the body. It applies on top of the context
// given to Publish: whichever ends first wins. d must be positive.
//
// Default: [DefaultTimeout] (10s).
func WithTimeout(d time.Duration) Option {
	return func(cfg *config) error {
		if d <= 0 {
			return fmt.Errorf("%w: WithTimeout: must be positive, got %v", outbox.ErrInvalidOption, d)
		}
		cfg.timeout = d
		return nil
	}
}

// WithSecret makes the publisher sign every body with HMAC-SHA256 keyed with
// secret, in the [HeaderSignature] header. The secret is copied; it never
// appears in errors. secret must not be empty.
//
// Default: no secret, no signature header.
func WithSecret(secret []byte) Option {
	return func(cfg *config) error {
		if len(secret) == 0 {
			return fmt.Errorf("%w: WithSecret: secret is empty", outbox.ErrInvalidOption)
		}
		cfg.secret = bytes.Clone(secret)
		return nil
	}
}

// WithHeader adds a static header to every request, for example an
// Authorization token. It may be given more than once; values for the same
// key accumulate. The key must be a valid header name other than
// Content-Type, User-Agent and the headers this package sets itself; the
// value must not contain control characters such as CR or LF.
//
// Default: no extra headers.
func WithHeader(key, value string) Option {
	return func(cfg *config) error {
		if !validHeaderName(key) {
			return fmt.Errorf("%w: WithHeader: invalid header name %q", outbox.ErrInvalidOption, key)
		}
		switch http.CanonicalHeaderKey(key) {
		case "Content-Type", "User-Agent", HeaderIdempotencyKey, HeaderBatchSize, HeaderSignature:
			return fmt.Errorf("%w: WithHeader: %s is set by the publisher", outbox.ErrInvalidOption, http.CanonicalHeaderKey(key))
		}
		if !validHeaderValue(value) {
			return fmt.Errorf("%w: WithHeader: value for %s contains a control character", outbox.ErrInvalidOption, key)
		}
		cfg.header.Add(key, value)
		return nil
	}
}

// WithUserAgent sets the User-Agent header of every request. ua must not be
// empty and must not contain control characters.
//
// Default: [DefaultUserAgent].
func WithUserAgent(ua string) Option {
	return func(cfg *config) error {
		if ua == "" || !validHeaderValue(ua) {
			return fmt.Errorf("%w: WithUserAgent: must be non-empty without control characters, got %q", outbox.ErrInvalidOption, ua)
		}
		cfg.userAgent = ua
		return nil
	}
}

// New returns a publisher that posts batches to rawURL, which must be an
// absolute http or https URL with a host. It fails with an error wrapping
// [outbox.ErrInvalidOption] when rawURL or an option is invalid; the error
// names the culprit and never contains a password from rawURL.
func New(rawURL string, opts ...Option) (*Publisher, error) {
	u, err := url.Parse(rawURL)
	if err != nil {
		// url.Error repeats the whole input, password included: keep only
		// the reason.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, fmt.Errorf("%w: url: %v", outbox.ErrInvalidOption, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("%w: url: scheme must be http or https, got %q in %s", outbox.ErrInvalidOption, u.Scheme, u.Redacted())
	}
	if u.Host == "" {
		return nil, fmt.Errorf("%w: url: no host in %s", outbox.ErrInvalidOption, u.Redacted())
	}

	cfg := config{timeout: DefaultTimeout, header: make(http.Header), userAgent: DefaultUserAgent}
	for _, opt := range opts {
		if err := opt(&cfg); err != nil {
			return nil, err
		}
	}
	if cfg.client == nil {
		cfg.client = defaultClient()
	}
	return &Publisher{
		url:       rawURL,
		redacted:  u.Redacted(),
		client:    cfg.client,
		timeout:   cfg.timeout,
		secret:    cfg.secret,
		header:    cfg.header,
		userAgent: cfg.userAgent,
	}, nil
}

// defaultClient returns a client with its own connection pool that follows
// only the redirects that keep the method and body (307, 308).
func defaultClient() *http.Client {
	var transport http.RoundTripper = http.DefaultTransport
	if t, ok := http.DefaultTransport.(*http.Transport); ok {
		transport = t.Clone()
	}
	return &http.Client{
		Transport: transport,
		CheckRedirect: func(req *http.Request, via []*http.Request) error {
			if code := req.Response.StatusCode; code != http.StatusTemporaryRedirect && code != http.StatusPermanentRedirect {
				return http.ErrUseLastResponse
			}
			if len(via) >= 10 {
				return errors.New("stopped after 10 redirects")
			}
			return nil
		},
	}
}

// Publish posts b as JSON and reports the outcome:
//
//   - nil when the endpoint answered 2xx: every message was accepted;
//   - a retryable error for 408, 429 and 5xx responses, network errors,
//     timeouts and the end of ctx;
//   - a permanent error ([outbox.IsPermanent]) for any other response, for a
//     batch without an ID, and for a batch that cannot be encoded.
//
// When the endpoint answered, the error wraps a [*StatusError]. Publish never
// returns an [*outbox.PartialError]: a batch is accepted or refused as a
// whole. The response body is always closed.
func (p *Publisher) Publish(ctx context.Context, b outbox.Batch) error {
	if b.ID == "" || !validHeaderValue(b.ID) {
		return outbox.Permanent(fmt.Errorf("outboxhttp: batch ID %q cannot be sent as %s", b.ID, HeaderIdempotencyKey))
	}
	body, err := encodeBatch(b)
	if err != nil {
		return outbox.Permanent(fmt.Errorf("outboxhttp: encode batch %s: %w", b.ID, err))
	}

	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()

	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url, bytes.NewReader(body))
	if err != nil {
		return outbox.Permanent(fmt.Errorf("outboxhttp: POST %s: %w", p.redacted, err))
	}
	for key, values := range p.header {
		req.Header[key] = append([]string(nil), values...)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", p.userAgent)
	req.Header.Set(HeaderIdempotencyKey, b.ID)
	req.Header.Set(HeaderBatchSize, strconv.Itoa(len(b.Messages)))
	if len(p.secret) > 0 {
		req.Header.Set(HeaderSignature, sign(p.secret, body))
	}

	resp, err := p.client.Do(req)
	if err != nil {
		// The client's *url.Error repeats the URL; keep only the cause so
		// errors.Is(err, context.DeadlineExceeded) and friends still work.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fmt.Errorf("outboxhttp: POST %s: %w", p.redacted, err)
	}
	defer func() {
		_, _ = io.CopyN(io.Discard, resp.Body, drainLimit)
		_ = resp.Body.Close()
	}()

	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		// A client that follows 301/302/303 turns the POST into a GET: a 2xx
		// for that GET says nothing about the batch.
		if resp.Request != nil && resp.Request.Method != http.MethodPost {
			return outbox.Permanent(fmt.Errorf("outboxhttp: POST %s: redirected to %s %s, batch not delivered",
				p.redacted, resp.Request.Method, resp.Request.URL.Redacted()))
		}
		return nil
	}

	head, _ := io.ReadAll(io.LimitReader(resp.Body, errorBodyLimit))
	serr := &StatusError{
		StatusCode: resp.StatusCode,
		Body:       string(head),
		RetryAfter: parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()),
	}
	err = fmt.Errorf("outboxhttp: POST %s: %w", p.redacted, serr)
	if retryableStatus(resp.StatusCode) {
		return err
	}
	return outbox.Permanent(err)
}

// encodeBatch is json.Marshal(b) without HTML escaping, so that payloads
// containing <, > or & keep those characters.
func encodeBatch(b outbox.Batch) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(b); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// StatusError reports a response whose status was not 2xx. Publish returns
// it wrapped; use errors.As to inspect it.
type StatusError struct {
	// StatusCode is the response's status code.
	StatusCode int
	// Body is at most the first 512 bytes of the response body, as received.
	Body string
	// RetryAfter is the delay the Retry-After header asked for, given either
	// in seconds or as an HTTP date; 0 when the header is absent, malformed or
	// in the past.
	RetryAfter time.Duration
}

// Error describes the status, the requested delay if any, and the start of the
// body, on one line.
// RetryDelay returns RetryAfter, so that the dispatcher waits at least as
// long as the receiver asked before trying again (see outbox.RetryDelayer).
func (e *StatusError) RetryDelay() time.Duration { return e.RetryAfter }

func (e *StatusError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "status %d", e.StatusCode)
	if text := http.StatusText(e.StatusCode); text != "" {
		b.WriteString(" " + text)
	}
	if e.RetryAfter > 0 {
		fmt.Fprintf(&b, " (retry after %v)", e.RetryAfter)
	}
	if e.Body != "" {
		fmt.Fprintf(&b, ": %q", e.Body)
	}
	return b.String()
}

// retryableStatus reports whether a non-2xx status is worth retrying.
func retryableStatus(code int) bool {
	return code == http.StatusRequestTimeout || code == http.StatusTooManyRequests || code >= 500
}

// parseRetryAfter reads a Retry-After value: delay-seconds or an HTTP date.
func parseRetryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if secs, err := strconv.ParseInt(v, 10, 64); err == nil {
		if secs <= 0 || secs > int64(time.Duration(1<<63-1)/time.Second) {
			return 0
		}
		return time.Duration(secs) * time.Second
	}
	if at, err := http.ParseTime(v); err == nil && at.After(now) {
		return at.Sub(now)
	}
	return 0
}

// digest returns HMAC-SHA256(secret, body).
func digest(secret, body []byte) []byte {
	mac := hmac.New(sha256.New, secret)
	mac.Write(body)
	return mac.Sum(nil)
}

// sign returns the HeaderSignature value for body.
func sign(secret, body []byte) string {
	return signaturePrefix + hex.EncodeToString(digest(secret, body))
}

// validHeaderName reports whether s is a non-empty RFC 9110 token.
func validHeaderName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9':
		case strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0:
		default:
			return false
		}
	}
	return true
}

// validHeaderValue reports whether s has no control characters other than
// horizontal tab, so the transport will not refuse it.
func validHeaderValue(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < ' ' && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}
