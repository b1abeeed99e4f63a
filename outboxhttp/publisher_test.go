package outboxhttp_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

// testBatch returns a two-message batch. Payloads are compact JSON, so they
// survive the round trip byte for byte; one contains characters that
// json.Marshal would HTML-escape by default.
func testBatch() outbox.Batch {
	at := time.Date(2024, 5, 6, 7, 8, 9, 123456000, time.UTC)
	return outbox.Batch{
		ID: "batch-7f3a",
		Messages: []outbox.Message{
			{
				EventID: "evt-1", EventType: "order.created",
				AggregateType: "order", AggregateID: "42", Sequence: 1,
				IdempotencyKey: "evt-1",
				Payload:        json.RawMessage(`{"total":1250,"note":"<b>&</b>"}`),
				Headers:        map[string]string{"trace_id": "abc"},
				OccurredAt:     at, Attempt: 1,
			},
			{
				EventID: "evt-2", EventType: "order.paid",
				AggregateType: "order", AggregateID: "42", Sequence: 2,
				IdempotencyKey: "pay-42",
				Payload:        json.RawMessage(`{"amount":1250}`),
				OccurredAt:     at.Add(time.Second), Attempt: 3,
			},
		},
	}
}

// received is what a recording server saw of one request.
type received struct {
	method string
	header http.Header
	body   []byte
}

// recordingServer answers every request with status and sends what it
// received on the returned channel.
func recordingServer(t *testing.T, status int) (*httptest.Server, <-chan received) {
	t.Helper()
	ch := make(chan received, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			t.Errorf("server: read body: %v", err)
		}
		ch <- received{method: r.Method, header: r.Header.Clone(), body: body}
		w.WriteHeader(status)
	}))
	t.Cleanup(srv.Close)
	return srv, ch
}

// statusServer answers every request with status, the given headers and body.
func statusServer(t *testing.T, status int, header map[string]string, body string) *httptest.Server {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		for k, v := range header {
			w.Header().Set(k, v)
		}
		w.WriteHeader(status)
		_, _ = io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	return srv
}

func newPublisher(t *testing.T, url string, opts ...outboxhttp.Option) *outboxhttp.Publisher {
	t.Helper()
	p, err := outboxhttp.New(url, opts...)
	if err != nil {
		t.Fatalf("New(%q): %v", url, err)
	}
	return p
}

// hmacHex computes the expected signature independently of the package.
func hmacHex(secret, body []byte) string {
	mac := hmac.New(sha256.New, secret)
	mac.Write(body)
	return "sha256=" + hex.EncodeToString(mac.Sum(nil))
}

func TestPublishSendsBatchAsJSONPost(t *testing.T) {
	t.Parallel()
	srv, got := recordingServer(t, http.StatusOK)
	b := testBatch()

	if err := newPublisher(t, srv.URL).Publish(context.Background(), b); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	req := <-got
	if req.method != http.MethodPost {
		t.Errorf("method = %s, want POST", req.method)
	}
	if ct := req.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("Content-Type = %q, want application/json", ct)
	}
	if key := req.header.Get("Idempotency-Key"); key != b.ID {
		t.Errorf("Idempotency-Key = %q, want %q", key, b.ID)
	}
	if n := req.header.Get("Outbox-Batch-Size"); n != "2" {
		t.Errorf("Outbox-Batch-Size = %q, want 2", n)
	}
	if sig := req.header.Get("Outbox-Signature"); sig != "" {
		t.Errorf("Outbox-Signature = %q without a secret, want none", sig)
	}
	var decoded outbox.Batch
	if err := json.Unmarshal(req.body, &decoded); err != nil {
		t.Fatalf("body is not a batch: %v\n%s", err, req.body)
	}
	if !reflect.DeepEqual(decoded, b) {
		t.Errorf("decoded batch differs:\n got %+v\nwant %+v", decoded, b)
	}
	for i := range b.Messages {
		if g, w := string(decoded.Messages[i].Payload), string(b.Messages[i].Payload); g != w {
			t.Errorf("message %d payload = %s, want %s", i, g, w)
		}
	}
}

func TestPublishSendsConfiguredHeaders(t *testing.T) {
	t.Parallel()
	srv, got := recordingServer(t, http.StatusNoContent)
	p := newPublisher(t, srv.URL,
		outboxhttp.WithHeader("Authorization", "Bearer t0ken"),
		outboxhttp.WithHeader("X-Tenant", "a"),
		outboxhttp.WithHeader("X-Tenant", "b"),
		outboxhttp.WithUserAgent("billing-dispatcher/2"),
	)

	if err := p.Publish(context.Background(), testBatch()); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	req := <-got
	if v := req.header.Get("Authorization"); v != "Bearer t0ken" {
		t.Errorf("Authorization = %q", v)
	}
	if v := req.header.Values("X-Tenant"); !reflect.DeepEqual(v, []string{"a", "b"}) {
		t.Errorf("X-Tenant = %q, want [a b]", v)
	}
	if v := req.header.Get("User-Agent"); v != "billing-dispatcher/2" {
		t.Errorf("User-Agent = %q", v)
	}
}

func TestPublishMapsStatus(t *testing.T) {
	t.Parallel()
	tests := []struct {
		status    int
		wantErr   bool
		permanent bool
	}{
		{http.StatusOK, false, false},
		{http.StatusCreated, false, false},
		{http.StatusNoContent, false, false},
		{http.StatusRequestTimeout, true, false},
		{http.StatusTooManyRequests, true, false},
		{http.StatusInternalServerError, true, false},
		{http.StatusBadGateway, true, false},
		{http.StatusServiceUnavailable, true, false},
		{http.StatusBadRequest, true, true},
		{http.StatusUnauthorized, true, true},
		{http.StatusNotFound, true, true},
		{http.StatusConflict, true, true},
		{http.StatusUnprocessableEntity, true, true},
		{http.StatusMovedPermanently, true, true},
	}
	for _, tt := range tests {
		t.Run(http.StatusText(tt.status), func(t *testing.T) {
			t.Parallel()
			srv := statusServer(t, tt.status, map[string]string{"Location": "/elsewhere"}, "reason")

			err := newPublisher(t, srv.URL).Publish(context.Background(), testBatch())
			if !tt.wantErr {
				if err != nil {
					t.Fatalf("Publish: %v, want nil", err)
				}
				return
			}
			if err == nil {
				t.Fatal("Publish: nil, want an error")
			}
			if got := outbox.IsPermanent(err); got != tt.permanent {
				t.Errorf("IsPermanent = %v, want %v (err: %v)", got, tt.permanent, err)
			}
			var se *outboxhttp.StatusError
			if !errors.As(err, &se) {
				t.Fatalf("error %v is not a *StatusError", err)
			}
			if se.StatusCode != tt.status {
				t.Errorf("StatusCode = %d, want %d", se.StatusCode, tt.status)
			}
			if se.Body != "reason" {
				t.Errorf("Body = %q, want %q", se.Body, "reason")
			}
		})
	}
}

func TestPublishParsesRetryAfter(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name     string
		header   string
		min, max time.Duration
	}{
		{"absent", "", 0, 0},
		{"seconds", "120", 120 * time.Second, 120 * time.Second},
		{"zero", "0", 0, 0},
		{"http date", time.Now().Add(time.Hour).UTC().Format(http.TimeFormat), 58 * time.Minute, time.Hour},
		{"date in the past", time.Now().Add(-time.Hour).UTC().Format(http.TimeFormat), 0, 0},
		{"garbage", "soon", 0, 0},
		{"negative", "-5", 0, 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			header := map[string]string{}
			if tt.header != "" {
				header["Retry-After"] = tt.header
			}
			srv := statusServer(t, http.StatusServiceUnavailable, header, "")

			err := newPublisher(t, srv.URL).Publish(context.Background(), testBatch())
			var se *outboxhttp.StatusError
			if !errors.As(err, &se) {
				t.Fatalf("error %v is not a *StatusError", err)
			}
			if se.RetryAfter < tt.min || se.RetryAfter > tt.max {
				t.Errorf("RetryAfter = %v, want in [%v, %v]", se.RetryAfter, tt.min, tt.max)
			}
		})
	}
}

func TestPublishKeepsOnlyStartOfErrorBody(t *testing.T) {
	t.Parallel()
	srv := statusServer(t, http.StatusBadRequest, nil, strings.Repeat("x", 5000))

	err := newPublisher(t, srv.URL).Publish(context.Background(), testBatch())
	var se *outboxhttp.StatusError
	if !errors.As(err, &se) {
		t.Fatalf("error %v is not a *StatusError", err)
	}
	if len(se.Body) != 512 {
		t.Errorf("len(Body) = %d, want 512", len(se.Body))
	}
}

func TestPublishTimesOutAsRetryable(t *testing.T) {
	t.Parallel()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-release
	}))
	t.Cleanup(srv.Close)
	t.Cleanup(func() { close(release) }) // runs before srv.Close, which waits for the handler
	p := newPublisher(t, srv.URL, outboxhttp.WithTimeout(50*time.Millisecond))

	done := make(chan error, 1)
	go func() { done <- p.Publish(context.Background(), testBatch()) }()
	var err error
	select {
	case err = <-done:
	case <-time.After(5 * time.Second): // far below the 10s default timeout
		t.Fatal("Publish did not return; WithTimeout was not applied")
	}
	if err == nil {
		t.Fatal("Publish: nil, want a timeout error")
	}
	if outbox.IsPermanent(err) {
		t.Errorf("timeout is permanent: %v", err)
	}
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("error %v does not wrap context.DeadlineExceeded", err)
	}
}

func TestPublishHonoursCallerContext(t *testing.T) {
	t.Parallel()
	srv, got := recordingServer(t, http.StatusOK)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()

	err := newPublisher(t, srv.URL).Publish(ctx, testBatch())
	if !errors.Is(err, context.Canceled) || outbox.IsPermanent(err) {
		t.Errorf("Publish with a cancelled context = %v, want a retryable context.Canceled", err)
	}
	select {
	case <-got:
		t.Error("request reached the server despite the cancelled context")
	default:
	}
}

func TestPublishNetworkErrorIsRetryable(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close()

	err := newPublisher(t, url).Publish(context.Background(), testBatch())
	if err == nil {
		t.Fatal("Publish to a closed server: nil, want an error")
	}
	if outbox.IsPermanent(err) {
		t.Errorf("network error is permanent: %v", err)
	}
	var se *outboxhttp.StatusError
	if errors.As(err, &se) {
		t.Errorf("network error carries a StatusError: %v", err)
	}
}

func TestPublishErrorRedactsURLPassword(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.NotFoundHandler())
	url := strings.Replace(srv.URL, "http://", "http://user:hunter2@", 1)
	srv.Close()

	err := newPublisher(t, url).Publish(context.Background(), testBatch())
	if err == nil || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("error = %v, want an error without the password", err)
	}
}

func TestPublishDoesNotFollowRedirectThatDropsBody(t *testing.T) {
	t.Parallel()
	target, got := recordingServer(t, http.StatusOK)
	srv := httptest.NewServer(http.RedirectHandler(target.URL, http.StatusFound))
	t.Cleanup(srv.Close)

	err := newPublisher(t, srv.URL).Publish(context.Background(), testBatch())
	var se *outboxhttp.StatusError
	if !outbox.IsPermanent(err) || !errors.As(err, &se) || se.StatusCode != http.StatusFound {
		t.Errorf("Publish through a 302 = %v, want a permanent StatusError 302", err)
	}
	select {
	case <-got:
		t.Error("the redirect was followed")
	default:
	}
}

func TestPublishFollowsRedirectThatKeepsBody(t *testing.T) {
	t.Parallel()
	target, got := recordingServer(t, http.StatusOK)
	srv := httptest.NewServer(http.RedirectHandler(target.URL, http.StatusTemporaryRedirect))
	t.Cleanup(srv.Close)
	b := testBatch()

	if err := newPublisher(t, srv.URL).Publish(context.Background(), b); err != nil {
		t.Fatalf("Publish through a 307: %v", err)
	}
	req := <-got
	var decoded outbox.Batch
	if req.method != http.MethodPost || json.Unmarshal(req.body, &decoded) != nil || decoded.ID != b.ID {
		t.Errorf("redirected request: %s %s, want the POSTed batch", req.method, req.body)
	}
}

func TestPublishRejectsRedirectToGetWithCustomClient(t *testing.T) {
	t.Parallel()
	target := statusServer(t, http.StatusOK, nil, "")
	srv := httptest.NewServer(http.RedirectHandler(target.URL, http.StatusSeeOther))
	t.Cleanup(srv.Close)
	p := newPublisher(t, srv.URL, outboxhttp.WithClient(&http.Client{})) // follows every redirect

	err := p.Publish(context.Background(), testBatch())
	if !outbox.IsPermanent(err) {
		t.Errorf("Publish answered by a GET after a 303 = %v, want a permanent error", err)
	}
}

func TestPublishRejectsUnsendableBatchWithoutRequest(t *testing.T) {
	t.Parallel()
	noID := testBatch()
	noID.ID = ""
	badID := testBatch()
	badID.ID = "a\r\nInjected: yes"
	badPayload := testBatch()
	badPayload.Messages[0].Payload = json.RawMessage(`{"unterminated":`)
	tests := []struct {
		name  string
		batch outbox.Batch
	}{
		{"empty batch ID", noID},
		{"batch ID with CRLF", badID},
		{"invalid payload JSON", badPayload},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			srv, got := recordingServer(t, http.StatusOK)

			err := newPublisher(t, srv.URL).Publish(context.Background(), tt.batch)
			if !outbox.IsPermanent(err) {
				t.Errorf("Publish = %v, want a permanent error", err)
			}
			select {
			case <-got:
				t.Error("a request was sent")
			default:
			}
		})
	}
}

func TestPublishSignsBody(t *testing.T) {
	t.Parallel()
	secret := []byte("s3cret-key")
	srv, got := recordingServer(t, http.StatusOK)

	if err := newPublisher(t, srv.URL, outboxhttp.WithSecret(secret)).Publish(context.Background(), testBatch()); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	req := <-got
	sig := req.header.Get("Outbox-Signature")
	if want := hmacHex(secret, req.body); sig != want {
		t.Errorf("Outbox-Signature = %q, want %q", sig, want)
	}
	if !outboxhttp.Verify(secret, req.body, sig) {
		t.Error("Verify rejected the publisher's own signature")
	}
}

func TestVerifyRejects(t *testing.T) {
	t.Parallel()
	secret := []byte("s3cret-key")
	body := []byte(`{"batch_id":"b","messages":[]}`)
	valid := hmacHex(secret, body)
	tests := []struct {
		name   string
		secret []byte
		body   []byte
		header string
	}{
		{"tampered body", secret, []byte(`{"batch_id":"c","messages":[]}`), valid},
		{"wrong secret", []byte("other-key"), body, valid},
		{"empty secret", nil, body, hmacHex(nil, body)},
		{"missing header", secret, body, ""},
		{"no prefix", secret, body, strings.TrimPrefix(valid, "sha256=")},
		{"other algorithm", secret, body, "sha1=" + strings.TrimPrefix(valid, "sha256=")},
		{"not hex", secret, body, "sha256=" + strings.Repeat("zz", 32)},
		{"truncated", secret, body, valid[:len(valid)-2]},
		{"extended", secret, body, valid + "00"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			if outboxhttp.Verify(tt.secret, tt.body, tt.header) {
				t.Errorf("Verify(%q, %s, %q) = true, want false", tt.secret, tt.body, tt.header)
			}
		})
	}
}

func TestDecodeRequestRoundTrips(t *testing.T) {
	t.Parallel()
	tests := []struct {
		name   string
		secret []byte
	}{
		{"signed", []byte("s3cret-key")},
		{"unsigned", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			decoded := make(chan outbox.Batch, 1)
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, err := outboxhttp.DecodeRequest(r, tt.secret, 1<<20)
				if err != nil {
					t.Errorf("DecodeRequest: %v", err)
					http.Error(w, err.Error(), http.StatusBadRequest)
					return
				}
				decoded <- b
			}))
			t.Cleanup(srv.Close)
			var opts []outboxhttp.Option
			if tt.secret != nil {
				opts = append(opts, outboxhttp.WithSecret(tt.secret))
			}
			b := testBatch()

			if err := newPublisher(t, srv.URL, opts...).Publish(context.Background(), b); err != nil {
				t.Fatalf("Publish: %v", err)
			}
			if got := <-decoded; !reflect.DeepEqual(got, b) {
				t.Errorf("DecodeRequest returned\n %+v\nwant %+v", got, b)
			}
		})
	}
}

func TestDecodeRequestRejects(t *testing.T) {
	t.Parallel()
	secret := []byte("s3cret-key")
	body := `{"batch_id":"b1","messages":[{"event_id":"e1","payload":{}}]}`
	tests := []struct {
		name     string
		method   string
		body     string
		header   map[string]string // on top of valid headers; "" deletes
		maxBytes int64
		want     error
	}{
		{name: "bad signature", header: map[string]string{"Outbox-Signature": hmacHex([]byte("other"), []byte(body))}, want: outboxhttp.ErrBadSignature},
		{name: "missing signature", header: map[string]string{"Outbox-Signature": ""}, want: outboxhttp.ErrBadSignature},
		{name: "oversized body", maxBytes: int64(len(body)) - 1, want: outboxhttp.ErrTooLarge},
		{name: "mismatched Idempotency-Key", header: map[string]string{"Idempotency-Key": "b2"}, want: outboxhttp.ErrMalformed},
		{name: "missing Idempotency-Key", header: map[string]string{"Idempotency-Key": ""}, want: outboxhttp.ErrMalformed},
		{name: "mismatched batch size", header: map[string]string{"Outbox-Batch-Size": "2"}, want: outboxhttp.ErrMalformed},
		{name: "wrong content type", header: map[string]string{"Content-Type": "text/plain"}, want: outboxhttp.ErrMalformed},
		{name: "wrong method", method: http.MethodPut, want: outboxhttp.ErrMalformed},
		{name: "invalid JSON", body: `{"batch_id":"b1",`, want: outboxhttp.ErrMalformed},
		{name: "trailing data", body: body + `{}`, want: outboxhttp.ErrMalformed},
		{name: "empty batch_id", body: `{"batch_id":"","messages":[]}`, header: map[string]string{"Idempotency-Key": ""}, want: outboxhttp.ErrMalformed},
		{name: "message without event_id", body: `{"batch_id":"b1","messages":[{"payload":{}}]}`, want: outboxhttp.ErrMalformed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			method, reqBody, maxBytes := http.MethodPost, body, int64(1<<20)
			if tt.method != "" {
				method = tt.method
			}
			if tt.body != "" {
				reqBody = tt.body
			}
			if tt.maxBytes != 0 {
				maxBytes = tt.maxBytes
			}
			r := httptest.NewRequest(method, "/hook", strings.NewReader(reqBody))
			r.Header.Set("Content-Type", "application/json")
			r.Header.Set("Idempotency-Key", "b1")
			r.Header.Set("Outbox-Batch-Size", "1")
			r.Header.Set("Outbox-Signature", hmacHex(secret, []byte(reqBody)))
			for k, v := range tt.header {
				if v == "" {
					r.Header.Del(k)
				} else {
					r.Header.Set(k, v)
				}
			}

			_, err := outboxhttp.DecodeRequest(r, secret, maxBytes)
			if !errors.Is(err, tt.want) {
				t.Errorf("DecodeRequest = %v, want %v", err, tt.want)
			}
		})
	}
}

func TestDecodeRequestLimitsUnknownLengthBody(t *testing.T) {
	t.Parallel()
	r := httptest.NewRequest(http.MethodPost, "/hook", strings.NewReader(strings.Repeat(" ", 100)))
	r.ContentLength = -1 // as for a chunked request
	r.Header.Set("Content-Type", "application/json")

	if _, err := outboxhttp.DecodeRequest(r, nil, 10); !errors.Is(err, outboxhttp.ErrTooLarge) {
		t.Errorf("DecodeRequest = %v, want ErrTooLarge", err)
	}
}

func TestNewRejectsInvalidConfiguration(t *testing.T) {
	t.Parallel()
	const ok = "https://gateway.example/hooks"
	tests := []struct {
		name     string
		url      string
		opts     []outboxhttp.Option
		mentions string
	}{
		{"unparsable URL", "http://[::1", nil, "url"},
		{"relative URL", "/hooks/outbox", nil, "url"},
		{"ftp scheme", "ftp://files.example/outbox", nil, "url"},
		{"no host", "http:///hooks", nil, "url"},
		{"zero timeout", ok, []outboxhttp.Option{outboxhttp.WithTimeout(0)}, "WithTimeout"},
		{"negative timeout", ok, []outboxhttp.Option{outboxhttp.WithTimeout(-time.Second)}, "WithTimeout"},
		{"empty secret", ok, []outboxhttp.Option{outboxhttp.WithSecret(nil)}, "WithSecret"},
		{"nil client", ok, []outboxhttp.Option{outboxhttp.WithClient(nil)}, "WithClient"},
		{"empty header name", ok, []outboxhttp.Option{outboxhttp.WithHeader("", "v")}, "WithHeader"},
		{"header name with space", ok, []outboxhttp.Option{outboxhttp.WithHeader("X Bad", "v")}, "WithHeader"},
		{"header value with newline", ok, []outboxhttp.Option{outboxhttp.WithHeader("X-Ok", "a\r\nb")}, "WithHeader"},
		{"reserved header", ok, []outboxhttp.Option{outboxhttp.WithHeader("idempotency-key", "v")}, "WithHeader"},
		{"empty user agent", ok, []outboxhttp.Option{outboxhttp.WithUserAgent("")}, "WithUserAgent"},
		{"zero max body", ok, []outboxhttp.Option{outboxhttp.WithMaxBodyBytes(0)}, "WithMaxBodyBytes"},
		{"negative max body", ok, []outboxhttp.Option{outboxhttp.WithMaxBodyBytes(-1)}, "WithMaxBodyBytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			p, err := outboxhttp.New(tt.url, tt.opts...)
			if !errors.Is(err, outbox.ErrInvalidOption) {
				t.Fatalf("New = %v, %v; want an error wrapping ErrInvalidOption", p, err)
			}
			if !strings.Contains(err.Error(), tt.mentions) {
				t.Errorf("error %q does not name %s", err, tt.mentions)
			}
		})
	}
}

func TestNewErrorRedactsURLPassword(t *testing.T) {
	t.Parallel()
	for _, url := range []string{"ftp://user:hunter2@files.example/", "http://user:hunter2@[::1"} {
		_, err := outboxhttp.New(url)
		if err == nil || strings.Contains(err.Error(), "hunter2") {
			t.Errorf("New(%q) = %v, want an error without the password", url, err)
		}
	}
}
