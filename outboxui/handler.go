package outboxui

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"html/template"
	"io/fs"
	"net/http"
	"strings"
	"time"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/outboxinspect"
)

// Defaults of the options.
const (
	// DefaultRefresh is how often the overview refreshes itself.
	DefaultRefresh = 5 * time.Second
	// CookieName is the session cookie that the login page sets under
	// [WithToken].
	CookieName = "outboxui_session"
)

// Option configures [Handler].
type Option func(*config)

type config struct {
	auth     func(*http.Request) bool
	token    string
	hasToken bool
	refresh  time.Duration
	problems []string
}

// WithAuth lets in the requests for which allow returns true; the others
// get 401. allow runs for every request but those of the embedded
// stylesheet and script and of the login form, which are the same for
// everyone and show nothing of the table. A nil
// allow is a configuration error: every request then gets 401 naming it.
func WithAuth(allow func(*http.Request) bool) Option {
	return func(c *config) {
		if allow == nil {
			c.problems = append(c.problems, "WithAuth: nil function")
			return
		}
		c.auth = allow
	}
}

// WithToken lets in the requests that carry token as a bearer token
// ("Authorization: Bearer <token>") or the session cookie [CookieName]
// that the login form sets once the token was typed in (HttpOnly,
// SameSite=Strict, for the path the handler is mounted at). The token
// must be at least 16 bytes; a shorter one is a configuration error and
// every request then gets 401 naming it. With [WithAuth] as well, a
// request needs to pass only one of them.
func WithToken(token string) Option {
	return func(c *config) {
		if len(token) < 16 {
			c.problems = append(c.problems, "WithToken: the token is shorter than 16 bytes")
			return
		}
		c.token, c.hasToken = token, true
	}
}

// WithRefresh sets how often the overview page refreshes its counts and
// chart (default [DefaultRefresh], at least a second; a shorter interval
// is a configuration error).
func WithRefresh(interval time.Duration) Option {
	return func(c *config) {
		if interval < time.Second {
			c.problems = append(c.problems, "WithRefresh: "+interval.String()+" is shorter than a second")
			return
		}
		c.refresh = interval
	}
}

//go:embed templates/*.html
var templateFS embed.FS

//go:embed static
var staticFS embed.FS

// ui is the dashboard of one dispatcher.
type ui struct {
	d     *outbox.Dispatcher
	in    *outboxinspect.Inspector
	cfg   config
	pages map[string]*template.Template
	// session is the value of the session cookie: an HMAC of a fixed
	// label under the token, so that the cookie is not the token.
	session string
}

// Handler returns the dashboard of d's table as an http.Handler, to mount
// at any path (with http.StripPrefix, as in the package example). Without
// [WithAuth] or [WithToken], or with an invalid option, it refuses every
// request with 401 and a body saying why. d is only read, and requeued
// and discarded through; the handler never runs it.
func Handler(d *outbox.Dispatcher, opts ...Option) http.Handler {
	cfg := config{refresh: DefaultRefresh}
	for _, opt := range opts {
		opt(&cfg)
	}
	if d == nil || d.DB() == nil {
		cfg.problems = append(cfg.problems, "Handler: no dispatcher made by outbox.NewDispatcher")
	}
	if len(cfg.problems) > 0 {
		return refuse("outboxui: invalid configuration: " + strings.Join(cfg.problems, "; "))
	}
	if cfg.auth == nil && !cfg.hasToken {
		return refuse("outboxui: no authentication configured: pass outboxui.WithAuth or outboxui.WithToken to outboxui.Handler; until then every request is refused")
	}
	u := &ui{d: d, in: outboxinspect.New(d), cfg: cfg, pages: parsePages()}
	if cfg.hasToken {
		m := hmac.New(sha256.New, []byte(cfg.token))
		m.Write([]byte("outboxui session"))
		u.session = hex.EncodeToString(m.Sum(nil))
	}
	mux := http.NewServeMux()
	static, _ := fs.Sub(staticFS, "static")
	mux.Handle("GET /static/", http.StripPrefix("/static/", http.FileServerFS(static)))
	mux.HandleFunc("GET /{$}", u.overview)
	mux.HandleFunc("GET /dead", u.dead)
	mux.HandleFunc("POST /requeue", u.requeue)
	mux.HandleFunc("POST /discard", u.discard)
	mux.HandleFunc("GET /message", u.message)
	mux.HandleFunc("GET /search", u.search)
	mux.HandleFunc("GET /login", u.loginPage)
	mux.HandleFunc("POST /login", u.login)
	mux.HandleFunc("POST /logout", u.logout)
	return http.NewCrossOriginProtection().Handler(u.secure(mux))
}

// refuse answers every request with 401 and why.
func refuse(why string) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, why, http.StatusUnauthorized)
	})
}

// secure sets the headers of every response and lets in only
// authenticated requests, and those of the login form.
func (u *ui) secure(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "same-origin")
		h.Set("Cache-Control", "no-store")
		login := r.URL.Path == "/login" || strings.HasPrefix(r.URL.Path, "/static/")
		if login || u.allowed(r) {
			next.ServeHTTP(w, r)
			return
		}
		u.unauthorized(w, r)
	})
}

func (u *ui) allowed(r *http.Request) bool {
	if u.cfg.auth != nil && u.cfg.auth(r) {
		return true
	}
	if !u.cfg.hasToken {
		return false
	}
	if bearer, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok &&
		subtle.ConstantTimeCompare([]byte(bearer), []byte(u.cfg.token)) == 1 {
		return true
	}
	c, err := r.Cookie(CookieName)
	return err == nil && subtle.ConstantTimeCompare([]byte(c.Value), []byte(u.session)) == 1
}

// unauthorized answers 401: with the login form for a browser under
// WithToken, with one line of text otherwise.
func (u *ui) unauthorized(w http.ResponseWriter, r *http.Request) {
	if u.cfg.hasToken && strings.Contains(r.Header.Get("Accept"), "text/html") {
		w.WriteHeader(http.StatusUnauthorized)
		u.render(w, r, "login", pageData{Title: "Sign in", Data: loginData{Error: "Sign in with the dashboard's token."}})
		return
	}
	w.Header().Set("WWW-Authenticate", `Bearer realm="outboxui"`)
	http.Error(w, "outboxui: not authorized: send the dashboard's token as a bearer token, or sign in at login", http.StatusUnauthorized)
}

type loginData struct{ Error string }

func (u *ui) loginPage(w http.ResponseWriter, r *http.Request) {
	if !u.cfg.hasToken {
		http.Error(w, "outboxui: this dashboard has no token to sign in with", http.StatusNotFound)
		return
	}
	u.render(w, r, "login", pageData{Title: "Sign in", Data: loginData{}})
}

func (u *ui) login(w http.ResponseWriter, r *http.Request) {
	if !u.cfg.hasToken {
		http.Error(w, "outboxui: this dashboard has no token to sign in with", http.StatusNotFound)
		return
	}
	if subtle.ConstantTimeCompare([]byte(r.PostFormValue("token")), []byte(u.cfg.token)) != 1 {
		w.WriteHeader(http.StatusUnauthorized)
		u.render(w, r, "login", pageData{Title: "Sign in", Data: loginData{Error: "That is not the dashboard's token."}})
		return
	}
	// No Path: the browser scopes the cookie to the directory of this
	// request's URL, which is where the handler is mounted.
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: u.session, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil, MaxAge: 12 * 3600})
	seeOther(w, "./")
}

func (u *ui) logout(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, &http.Cookie{Name: CookieName, Value: "", HttpOnly: true, SameSite: http.SameSiteStrictMode, MaxAge: -1})
	seeOther(w, "login")
}

// seeOther redirects to ref, a reference relative to the request's URL
// as the browser sent it. (http.Redirect would resolve it against the
// path after http.StripPrefix, which is not where the handler is mounted.)
func seeOther(w http.ResponseWriter, ref string) {
	w.Header().Set("Location", ref)
	w.WriteHeader(http.StatusSeeOther)
}
