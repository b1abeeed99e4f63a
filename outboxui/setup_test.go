package outboxui_test

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxui"
)

const token = "test-token-0123456789"

// site is a dashboard mounted under /outbox/ on a real database.
type site struct {
	db  *gorm.DB
	e   outboxtest.Engine
	d   *outbox.Dispatcher
	srv *httptest.Server
}

type nobody struct{}

func (nobody) Publish(context.Context, outbox.Batch) error { return nil }

// newSite migrates a fresh database on e and serves its dashboard, with
// opts (WithToken(token) when none is given).
func newSite(t *testing.T, e outboxtest.Engine, opts ...outboxui.Option) *site {
	t.Helper()
	db, _ := outboxtest.Open(t, e, nil)
	if err := db.Use(outbox.Plugin()); err != nil {
		t.Fatal(err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	d, err := outbox.NewDispatcher(db, nobody{}, outbox.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	if err != nil {
		t.Fatal(err)
	}
	if len(opts) == 0 {
		opts = []outboxui.Option{outboxui.WithToken(token)}
	}
	mux := http.NewServeMux()
	mux.Handle("/outbox/", http.StripPrefix("/outbox", outboxui.Handler(d, opts...)))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return &site{db: db, e: e, d: d, srv: srv}
}

func (s *site) url(path string) string { return s.srv.URL + "/outbox/" + path }

func (s *site) publish(t *testing.T, events ...outbox.Event) {
	t.Helper()
	for _, ev := range events {
		if err := outbox.Publish(s.db, ev); err != nil {
			t.Fatal(err)
		}
	}
}

func (s *site) exec(t *testing.T, sql string, args ...any) {
	t.Helper()
	if err := s.db.Exec(sql, args...).Error; err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func (s *site) ts(t time.Time) any {
	if s.e == outboxtest.SQLite {
		return t.UTC().Format("2006-01-02 15:04:05.000000000+00:00")
	}
	return t
}

func (s *site) state(t *testing.T, eventID string) string {
	t.Helper()
	var st string
	if err := s.db.Raw(`SELECT delivery_state FROM outbox_records WHERE event_id = ?`, eventID).Scan(&st).Error; err != nil {
		t.Fatal(err)
	}
	return st
}

// fail dead-letters the events ids.
func (s *site) fail(t *testing.T, ids ...string) {
	t.Helper()
	for _, id := range ids {
		s.exec(t, `UPDATE outbox_records SET delivery_state = 'failed', delivery_attempts = 10, last_error = 'broker said no', updated_at = ? WHERE event_id = ?`,
			s.ts(time.Now()), id)
	}
}

// do sends a request with the bearer token (unless bearer is empty) and
// returns the status and body.
func (s *site) do(t *testing.T, method, path, bearer string, body io.Reader, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, s.url(path), body)
	if err != nil {
		t.Fatal(err)
	}
	if bearer != "" {
		req.Header.Set("Authorization", "Bearer "+bearer)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	res, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	b, _ := io.ReadAll(res.Body)
	return res.StatusCode, string(b)
}

func mustContain(t *testing.T, what, body string, wants ...string) {
	t.Helper()
	for _, w := range wants {
		if !strings.Contains(body, w) {
			t.Fatalf("%s lacks %q:\n%s", what, w, body)
		}
	}
}
