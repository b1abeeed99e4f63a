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
	"mime"
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
	maxBody   int64
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
	maxBody   int64
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

// WithMaxBodyBytes bounds the body of each request to n bytes. A batch
// whose body would be larger goes in several requests, one after the
// other; a message that does not fit in a request of its own is not sent,
// and fails alone, permanently (see [Publisher.Publish]). Set it to the
// receiver's limit: a receiver that still answers 413 costs a few more
// requests, as Publish splits the refused request in halves to find the
// message too large. n must be positive.
//
// Default: [DefaultMaxBytes] (2 MiB), the limit [DecodeRequest] and
// inbox.Receiver apply unless told otherwise.
func WithMaxBodyBytes(n int64) Option {
	return func(cfg *config) error {
		if n <= 0 {
			return fmt.Errorf("%w: WithMaxBodyBytes: must be positive, got %d", outbox.ErrInvalidOption, n)
		}
		cfg.maxBody = n
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

	cfg := config{timeout: DefaultTimeout, header: make(http.Header), userAgent: DefaultUserAgent, maxBody: DefaultMaxBytes}
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
		maxBody:   cfg.maxBody,
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

// Publish sends b to the endpoint, in one request or, when its body would
// be larger than [WithMaxBodyBytes] or the endpoint answers 413, in
// several, and settles each message by the answers, as the package
// documentation describes:
//
//   - nil when every message was accepted;
//   - the error of the request, when a request that carried every message
//     failed as a whole (network error, timeout, end of ctx, a status
//     without results, results that do not describe it): retryable, or
//     permanent ([outbox.IsPermanent]) for a 4xx other than 408, 413 and
//     429 and for an unfollowed redirect; it wraps a [*StatusError] when
//     the endpoint answered;
//   - otherwise a wrapped [*outbox.PartialError] naming each message not
//     accepted: with the receiver's reason for a failed result (permanent
//     when the result says so), [outbox.ErrNotAttempted] for a message not
//     attempted or not sent behind one of its aggregate, a permanent
//     error wrapping [ErrTooLarge] for a message too large to send alone,
//     the error of the request that failed as a whole for the messages it
//     carried, and [outbox.ErrNotAttempted] for the messages the requests
//     after it would have carried, which are not sent.
//
// A batch without an ID, or one that cannot be encoded, fails permanently
// without a request. Every response body is closed.
func (p *Publisher) Publish(ctx context.Context, b outbox.Batch) error {
	if b.ID == "" || !validHeaderValue(b.ID) {
		return outbox.Permanent(fmt.Errorf("outboxhttp: batch ID %q cannot be sent as %s", b.ID, HeaderIdempotencyKey))
	}
	s := &sending{
		p:       p,
		batch:   b,
		enc:     make([][]byte, len(b.Messages)),
		errs:    make([]error, len(b.Messages)),
		settled: make([]bool, len(b.Messages)),
		blocked: make(map[aggregate]int),
	}
	for i, m := range b.Messages {
		var err error
		if s.enc[i], err = encodeJSON(m); err != nil {
			return outbox.Permanent(fmt.Errorf("outboxhttp: encode batch %s: event %s: %w", b.ID, m.EventID, err))
		}
	}
	if err := s.run(ctx); err != nil {
		return err
	}
	return s.result()
}

// sending is one call of Publish: the requests it makes and what became of
// each message of the batch.
type sending struct {
	p     *Publisher
	batch outbox.Batch
	enc   [][]byte // each message as JSON, in the batch's order
	// errs and settled are, per message, why it was not accepted (nil when
	// it was) and whether that is known yet.
	errs    []error
	settled []bool
	// blocked is, per aggregate, the position of its first message that
	// was not accepted: its later messages are not sent.
	blocked map[aggregate]int
	// requests counts the requests made.
	requests int
}

type aggregate struct{ typ, id string }

// answer is what one request's response says.
type answer struct {
	// errs is, per message of the request, nil when it was accepted or
	// why not; nil when the request failed as a whole.
	errs []error
	// err is why the request failed as a whole.
	err error
	// tooLarge: the endpoint answered 413 without results; err holds the
	// *StatusError.
	tooLarge bool
}

// run sends the batch in as many requests as its size and the endpoint's
// answers need, settling every message. When a request that carried the
// whole batch fails as a whole, it returns that request's error instead.
func (s *sending) run(ctx context.Context) error {
	all := make([]int, len(s.batch.Messages))
	for i := range all {
		all[i] = i
	}
	// queue holds runs of message positions, in the batch's order, still
	// to send; each is sent in as few requests as fit.
	queue := [][]int{all}
	for len(queue) > 0 {
		run := s.unblocked(queue[0])
		queue = queue[1:]
		if len(run) == 0 {
			continue
		}
		id := s.requestID(s.requests + 1)
		n, size := s.fit(id, run)
		if n == 0 {
			m := s.batch.Messages[run[0]]
			s.settle(run[0], outbox.Permanent(fmt.Errorf("%w: event %s makes a request of %d bytes on its own, more than the %d bytes of WithMaxBodyBytes",
				ErrTooLarge, m.EventID, size, s.p.maxBody)))
			queue = append([][]int{run[1:]}, queue...)
			continue
		}
		chunk := run[:n]
		if n < len(run) {
			queue = append([][]int{run[n:]}, queue...)
		}
		s.requests++
		a := s.post(ctx, id, chunk)
		switch {
		case a.tooLarge && len(chunk) > 1:
			half := len(chunk) / 2
			queue = append([][]int{chunk[:half], chunk[half:]}, queue...)
		case a.tooLarge:
			s.settle(chunk[0], outbox.Permanent(fmt.Errorf("%w: event %s makes a request of %d bytes on its own, answered %w",
				ErrTooLarge, s.batch.Messages[chunk[0]].EventID, size, a.err)))
		case a.errs != nil:
			for i, pos := range chunk {
				s.settle(pos, a.errs[i])
			}
		case len(chunk) == len(s.batch.Messages):
			// The request carried the whole batch: its error is the
			// batch's.
			return a.err
		default:
			// Whatever made this request fail would most likely fail the
			// rest: it is not sent, and its messages, which the receiver
			// never saw, come back without counting an attempt.
			for _, pos := range chunk {
				s.settle(pos, a.err)
			}
			for pos := range s.batch.Messages {
				if !s.settled[pos] {
					s.settle(pos, fmt.Errorf("%w: not sent, as request %s of the batch failed: %v", outbox.ErrNotAttempted, id, a.err))
				}
			}
			return nil
		}
	}
	return nil
}

// requestID is the batch_id of the n-th request (from 1) of the batch.
func (s *sending) requestID(n int) string {
	if n == 1 {
		return s.batch.ID
	}
	return s.batch.ID + "." + strconv.Itoa(n)
}

// unblocked returns the positions of run whose aggregate has no earlier
// message that was not accepted, and settles the others as not attempted.
func (s *sending) unblocked(run []int) []int {
	out := run[:0:0]
	for _, pos := range run {
		m := s.batch.Messages[pos]
		if first, ok := s.blocked[aggregate{m.AggregateType, m.AggregateID}]; ok && first < pos {
			s.settle(pos, fmt.Errorf("%w: %s of the same aggregate was not accepted", outbox.ErrNotAttempted, s.batch.Messages[first].EventID))
			continue
		}
		out = append(out, pos)
	}
	return out
}

// settle records what became of the message at pos.
func (s *sending) settle(pos int, err error) {
	s.errs[pos], s.settled[pos] = err, true
	if err == nil {
		return
	}
	m := s.batch.Messages[pos]
	agg := aggregate{m.AggregateType, m.AggregateID}
	if first, ok := s.blocked[agg]; !ok || pos < first {
		s.blocked[agg] = pos
	}
}

// result is what Publish returns once every message is settled.
func (s *sending) result() error {
	failed := make(map[string]error)
	for pos, err := range s.errs {
		if err != nil {
			failed[s.batch.Messages[pos].EventID] = err
		}
	}
	if len(failed) == 0 {
		return nil
	}
	return fmt.Errorf("outboxhttp: POST %s: batch %s: %w", s.p.redacted, s.batch.ID, &outbox.PartialError{Failed: failed})
}

// Parts of a request body around the batch_id and the messages.
const (
	bodyStart    = `{"batch_id":`
	bodyMessages = `,"messages":[`
	bodyEnd      = `]}`
)

// fit returns how many messages of run, from the first, fit in one request
// with batch_id id, and that request's size in bytes; 0 and the size of
// the request of the first message alone when even that does not fit.
func (s *sending) fit(id string, run []int) (n int, size int64) {
	idJSON, _ := encodeJSON(id) // a string always encodes
	size = int64(len(bodyStart) + len(idJSON) + len(bodyMessages) + len(bodyEnd))
	for i, pos := range run {
		add := int64(len(s.enc[pos]))
		if i > 0 {
			add++ // the comma
		}
		if size+add > s.p.maxBody {
			if i == 0 {
				return 0, size + add
			}
			return i, size
		}
		size += add
	}
	return len(run), size
}

// body is the request body of the messages at chunk, with batch_id id: the
// same bytes as the JSON of an outbox.Batch holding them.
func (s *sending) body(id string, chunk []int) []byte {
	idJSON, _ := encodeJSON(id)
	var buf bytes.Buffer
	buf.WriteString(bodyStart)
	buf.Write(idJSON)
	buf.WriteString(bodyMessages)
	for i, pos := range chunk {
		if i > 0 {
			buf.WriteByte(',')
		}
		buf.Write(s.enc[pos])
	}
	buf.WriteString(bodyEnd)
	return buf.Bytes()
}

// post sends the messages at chunk in one request with batch_id id, and
// reads what the response says of them.
func (s *sending) post(ctx context.Context, id string, chunk []int) answer {
	p := s.p
	body := s.body(id, chunk)
	ctx, cancel := context.WithTimeout(ctx, p.timeout)
	defer cancel()

	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url, bytes.NewReader(body))
	if err != nil {
		return answer{err: outbox.Permanent(fmt.Errorf("outboxhttp: POST %s: %w", p.redacted, err))}
	}
	for key, values := range p.header {
		req.Header[key] = append([]string(nil), values...)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("User-Agent", p.userAgent)
	req.Header.Set(HeaderIdempotencyKey, id)
	req.Header.Set(HeaderBatchSize, strconv.Itoa(len(chunk)))
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
		return answer{err: fmt.Errorf("outboxhttp: POST %s: %w", p.redacted, err)}
	}
	defer func() {
		_, _ = io.CopyN(io.Discard, resp.Body, drainLimit)
		_ = resp.Body.Close()
	}()

	success := resp.StatusCode >= 200 && resp.StatusCode < 300
	// A client that follows 301/302/303 turns the POST into a GET: a 2xx
	// for that GET says nothing about the batch.
	if success && resp.Request != nil && resp.Request.Method != http.MethodPost {
		return answer{err: outbox.Permanent(fmt.Errorf("outboxhttp: POST %s: redirected to %s %s, batch not delivered",
			p.redacted, resp.Request.Method, resp.Request.URL.Redacted()))}
	}

	retryAfter := parseRetryAfter(resp.Header.Get("Retry-After"), time.Now())
	limit := int64(errorBodyLimit)
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	if mt == "application/json" {
		limit = resultsLimit
	}
	head, _ := io.ReadAll(io.LimitReader(resp.Body, limit))
	if mt == "application/json" {
		msgs := make([]outbox.Message, len(chunk))
		for i, pos := range chunk {
			msgs[i] = s.batch.Messages[pos]
		}
		errs, ok, err := decodeResults(head, id, msgs, retryAfter)
		if err != nil {
			return answer{err: fmt.Errorf("outboxhttp: POST %s: status %d: %w", p.redacted, resp.StatusCode, err)}
		}
		if ok {
			return answer{errs: errs}
		}
	}
	if success {
		return answer{errs: make([]error, len(chunk))}
	}

	serr := &StatusError{
		StatusCode: resp.StatusCode,
		Body:       string(head[:min(len(head), errorBodyLimit)]),
		RetryAfter: retryAfter,
	}
	if resp.StatusCode == http.StatusRequestEntityTooLarge {
		return answer{tooLarge: true, err: serr}
	}
	err = fmt.Errorf("outboxhttp: POST %s: %w", p.redacted, serr)
	if retryableStatus(resp.StatusCode) {
		return answer{err: err}
	}
	return answer{err: outbox.Permanent(err)}
}

// encodeJSON is json.Marshal(v) without HTML escaping, so that payloads
// containing <, > or & keep those characters.
func encodeJSON(v any) ([]byte, error) {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(v); err != nil {
		return nil, err
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n")), nil
}

// StatusError reports a response without results whose status was not
// 2xx. Publish returns it wrapped, when a request failed as a whole; use
// errors.As to inspect it.
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

// RetryDelay returns RetryAfter, so that the dispatcher waits at least as
// long as the receiver asked before trying again (see outbox.RetryDelayer).
func (e *StatusError) RetryDelay() time.Duration { return e.RetryAfter }

// Error describes the status, the requested delay if any, and the start of the
// body, on one line.
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
