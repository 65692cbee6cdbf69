;;;; What an application's requests cost, beside the matrix's four-byte
;;;; handler: Hunchentoot's easy-acceptor and ours, each in one process
;;;; serving every handler below, as an application is served.  A session
;;;; counter (a returning user, its cookie made beforehand, and a new visitor
;;;; each request), a 5 KB HTML page with and without a session, a POST form
;;;; of three fields, a handler that sets a cookie and an easy-routes route
;;;; with a parameter (easy-routes from ../shared/vendor, when there).  The
;;;; returning user is measured with a few sessions in the table, then again
;;;; once it holds 100,000.  Woo (from ../shared/vendor, when there) is
;;;; raced on the cells it can do the same work for, the plain handler and
;;;; the page: it has none of Hunchentoot's sessions, easy handlers, form
;;;; parameters or routes.

(in-package #:hunchentoot-recycling-taskmaster-bench)

;;; The handlers, the same for Hunchentoot and ours.

(defun count-in-session ()
  "The session counter: start the session if there is none, add one to its
count, and the count as text."
  (princ-to-string (setf (ht:session-value 'visits) (1+ (or (ht:session-value 'visits) 0)))))

(ht:define-easy-handler (application-counter :uri "/app/counter") ()
  (count-request)
  (setf (ht:content-type*) "text/plain")
  (count-in-session))

(defparameter *page-octets* 5120
  "About how long the HTML page is.")

(defun html-page (title)
  "An HTML page of about *PAGE-OCTETS* characters, with TITLE and links, as
a templating library would make it."
  (with-output-to-string (out)
    (format out "<!DOCTYPE html>~%<html><head><title>~A</title>~
                 <link rel=\"stylesheet\" href=\"/static/site.css\"></head>~%<body><ul>~%" title)
    (loop for item from 1
          while (< (file-position out) (- *page-octets* 200))
          do (format out "<li><a href=\"/app/items/~D\">Item ~D</a>: a line of text about the item, ~
                          as a listing would have it.</li>~%" item item))
    (format out "</ul><form action=\"/app/form\" method=\"post\"><input name=\"name\"></form></body></html>~%")))

(defvar *page* (html-page "Items")
  "The page both page handlers answer.")

(ht:define-easy-handler (application-page :uri "/app/page") ()
  (setf (ht:content-type*) "text/html")
  *page*)

(ht:define-easy-handler (application-page-with-session :uri "/app/page-session") ()
  (setf (ht:content-type*) "text/html")
  (count-in-session)
  *page*)

(ht:define-easy-handler (application-form :uri "/app/form") (name email message)
  (setf (ht:content-type*) "text/plain")
  (format nil "Thank you, ~A (~A): ~D characters" name email (length message)))

(ht:define-easy-handler (application-set-cookie :uri "/app/set-cookie") ()
  (setf (ht:content-type*) "text/plain")
  (ht:set-cookie "theme" :value "dark" :path "/" :max-age 86400)
  "ok")

(ht:define-easy-handler (start-many-sessions :uri "/app/fill-sessions") ((n :parameter-type 'integer :init-form 0))
  "Start N sessions as N new visitors would, through START-SESSION (so that
Hunchentoot's session GC runs as it would); not measured."
  (setf (ht:content-type*) "text/plain")
  (loop repeat n
        do (setf (ht:session ht:*request*) nil
                 ht:*session* nil)
           (ht:start-session))
  (princ-to-string n))

;;; easy-routes, from ../shared/vendor, loaded at run time into the server.

(defun load-easy-routes ()
  "Load easy-routes and cl-routes from the vendor folder, and the route and
the acceptor classes of bench/applications-routes.lisp; true when they are
there."
  (let ((folders (mapcar (lambda (name) (merge-pathnames name (vendor-directory)))
                         '("easy-routes/" "cl-routes/"))))
    (when (every #'probe-file folders)
      (asdf:initialize-source-registry
       `(:source-registry ,@(loop for folder in folders collect `(:directory ,folder)) :inherit-configuration))
      (let ((*compile-verbose* nil) (*compile-print* nil))
        (handler-bind ((warning #'muffle-warning))
          (asdf:load-system "easy-routes")
          (load (compile-file (merge-pathnames "bench/applications-routes.lisp" (checkout-directory))
                              :output-file (merge-pathnames "applications-routes.fasl"
                                                            (uiop:default-temporary-directory))))))
      t)))

(defun serve-applications (kind port)
  "Serve the application handlers on 127.0.0.1:PORT with Hunchentoot's
acceptor (KIND :HUNCHENTOOT) or ours (:PARALLEL), mixed with easy-routes'
ROUTES-ACCEPTOR when it can be loaded, until killed."
  (let ((routes (load-easy-routes)))
    (start-hunchentoot port (if routes
                                (uiop:symbol-call '#:hunchentoot-recycling-taskmaster-bench '#:routes-acceptor-class kind)
                                (ecase kind
                                  (:hunchentoot 'ht:easy-acceptor)
                                  (:parallel 'hrt:parallel-easy-acceptor)))))
  (loop (sleep 3600)))

;;; The cells.

(defun application-request (method path &key cookie body)
  "The octets of one HTTP/1.1 request, as wrk sends them (no User-Agent),
closing the connection."
  (flet ((line (&rest parts) (format nil "~{~A~}~C~C" parts #\Return #\Linefeed)))
    (map '(vector (unsigned-byte 8)) #'char-code
         (concatenate 'string
                      (line method " " path " HTTP/1.1")
                      (line "Host: 127.0.0.1")
                      (if cookie (line "Cookie: " cookie) "")
                      (if body
                          (concatenate 'string (line "Content-Type: application/x-www-form-urlencoded")
                                       (line "Content-Length: " (length body)))
                          "")
                      (line "Connection: close")
                      (line)
                      (or body "")))))

(defun returning-user-cookie (port)
  "The Cookie header value of a new session of the server on PORT, made
by a request without User-Agent, as wrk's are."
  (let* ((head (nth-value 1 (send-and-read-reply port (application-request "GET" "/app/counter"))))
         (match (nth-value 1 (cl-ppcre:scan-to-strings "(?im)^set-cookie: (hunchentoot-session=[^;\\r]+)" head))))
    (or (and match (aref match 0))
        (error "GET /app/counter on port ~D gave no session cookie" port))))

(defparameter *form-body* "name=Ada+Lovelace&email=ada%40example.org&message=Hello%2C+I+would+like+to+know+more."
  "The POST form's body: three fields, escapes among them.")

(defun application-cells ()
  "Each cell, in the order measured in one server process: a name, the
path, the connections, and :COOKIE when it is sent with the returning
user's cookie, :FORM when it posts *FORM-BODY*, :FILL when the table is
filled to this many sessions first.  The returning user's cells run twice:
with a few sessions, then with 100,000."
  '(("plain c10" "/yo" 10)
    ("plain c100" "/yo" 100)
    ("counter, returning user c10" "/app/counter" 10 :cookie t)
    ("counter, returning user c100" "/app/counter" 100 :cookie t)
    ("5 KB page c100" "/app/page" 100)
    ("5 KB page with session c100" "/app/page-session" 100 :cookie t)
    ("POST form c100" "/app/form" 100 :form t)
    ("sets a cookie c100" "/app/set-cookie" 100)
    ("easy-routes route c100" "/app/items/42" 100 :route t)
    ("counter, new visitor c100" "/app/counter" 100)
    ("counter, returning user, 100,000 sessions c10" "/app/counter" 10 :cookie t :fill 100000)
    ("counter, returning user, 100,000 sessions c100" "/app/counter" 100 :cookie t)
    ("5 KB page with session, 100,000 sessions c100" "/app/page-session" 100 :cookie t)))

(defun application-wrk-script (directory &key cookie form)
  "A wrk Lua script in DIRECTORY adding COOKIE to each request, or making
it a POST of *FORM-BODY*; its path."
  (let ((path (merge-pathnames (format nil "application-~:[get~;post~]-~D.lua" form (random 1000000)) directory)))
    (with-open-file (out path :direction :output :if-exists :supersede)
      (when cookie
        (format out "wrk.headers[\"Cookie\"] = ~S~%" cookie))
      (when form
        (format out "wrk.method = \"POST\"~%wrk.body = ~S~%~
                     wrk.headers[\"Content-Type\"] = \"application/x-www-form-urlencoded\"~%"
                *form-body*)))
    path))

(defun wrk-application-cell (port path connections seconds script)
  "wrk's parsed figures for PATH on PORT over CONNECTIONS for SECONDS with SCRIPT."
  (parse-wrk (uiop:run-program (append (list "wrk" "-t2" (format nil "-c~D" connections) (format nil "-d~Ds" seconds)
                                             "--latency")
                                       (and script (list "-s" (namestring script)))
                                       (list (format nil "http://127.0.0.1:~D~A" port path)))
                               :output :string :error-output :output :ignore-error-status t)))

(defun fill-sessions (port count)
  "Have the server on PORT start sessions until COUNT more are in its
table, and wait until it has."
  (unless (equal (princ-to-string count)
                 (send-and-read-reply port (application-request "GET" (format nil "/app/fill-sessions?n=~D" count))))
    (error "The server on port ~D did not start ~D sessions" port count)))

(defun check-application-answers (port routes)
  "Signal an error unless the server on PORT answers each handler as it
should, the route only when ROUTES."
  (flet ((body (request) (send-and-read-reply port request)))
    (let ((cookie (returning-user-cookie port)))
      (unless (equal "2" (body (application-request "GET" "/app/counter" :cookie cookie)))
        (error "The returning user's second visit did not count 2")))
    (unless (search "Item 1</a>" (body (application-request "GET" "/app/page")))
      (error "GET /app/page did not answer the page"))
    (unless (search "Ada Lovelace (ada@example.org)" (body (application-request "POST" "/app/form" :body *form-body*)))
      (error "POST /app/form did not read its fields"))
    (when (and routes (not (equal "item 42" (body (application-request "GET" "/app/items/42")))))
      (error "The easy-routes route did not answer"))))

(defun measure-applications (kind seconds core directory)
  "Start the application server KIND, measure every cell of
APPLICATION-CELLS in order, stop it.  An alist of cell name and wrk's figures."
  (let* ((port (free-port))
         (process (uiop:launch-program
                   (list "sbcl" "--core" core "--noinform" "--non-interactive" "--disable-debugger"
                         "--eval" (format nil "(hunchentoot-recycling-taskmaster-bench::serve-applications ~S ~D)"
                                          kind port))
                   :output (namestring (merge-pathnames (format nil "applications-~(~A~).log" kind) directory))
                   :error-output :output :if-output-exists :supersede)))
    (unwind-protect
         (progn
           (unless (wait-until-serving port)
             (error "The ~(~A~) application server did not answer GET /yo within 30 s" kind))
           (let* ((routes (http-get port "/app/items/1"))
                  (cookie (returning-user-cookie port))
                  (cookie-script (application-wrk-script directory :cookie cookie))
                  (form-script (application-wrk-script directory :form t)))
             (check-application-answers port routes)
             (loop for (name path connections . options) in (application-cells)
                   for script = (cond ((getf options :cookie) cookie-script)
                                      ((getf options :form) form-script))
                   unless (and (getf options :route) (not routes))
                     collect (progn
                               (when (getf options :fill)
                                 (fill-sessions port (getf options :fill)))
                               (format t "~&  ~(~A~): ~A~%" kind name)
                               (finish-output)
                               (wrk-application-cell port path connections 1 script)
                               (cons name (wrk-application-cell port path connections seconds script))))))
      (stop-server process))))

(defparameter *woo-cells* '("plain c10" "plain c100" "5 KB page c100")
  "The application cells Woo can do the same work for.")

(defun measure-woo-applications (woo seconds directory)
  "Start WOO (a peer built by BUILD-PEER-CORE) serving the page from a file,
measure *WOO-CELLS*, stop it.  An alist as MEASURE-APPLICATIONS's."
  (let ((port (free-port))
        (page-file (merge-pathnames "page.html" directory)))
    (with-open-file (out page-file :direction :output :if-exists :supersede)
      (write-string *page* out))
    (let ((process (launch-peer woo port 0 (namestring (merge-pathnames "applications-woo.log" directory))
                              :page-file page-file)))
      (unwind-protect
           (progn
             (unless (wait-until-serving port)
               (error "Woo did not answer GET /yo within 30 s"))
             (unless (equal *page* (http-get port "/app/page"))
               (error "Woo did not answer the page"))
             (loop for (name path connections) in (application-cells)
                   when (member name *woo-cells* :test #'string=)
                     collect (progn
                               (format t "~&  woo: ~A~%" name)
                               (finish-output)
                               (wrk-application-cell port path connections 1 nil)
                               (cons name (wrk-application-cell port path connections seconds nil)))))
        (stop-server process)))))

(defun application-ratio (cells over under)
  "The requests/s of the cell named OVER as a fraction of the cell UNDER's, of CELLS."
  (ratio-to (getf (cdr (assoc over cells :test #'string=)) :requests-per-second)
            (getf (cdr (assoc under cells :test #'string=)) :requests-per-second)))

(defun median-application-cells (rounds)
  "Of ROUNDS (each an alist of one server's cells), the cells with each
cell's median requests/s."
  (loop for (name) in (first rounds)
        collect (cons name (median-cell (mapcar (lambda (round) (cdr (assoc name round :test #'string=))) rounds)))))

(defun application-summary (hunchentoot ours woo rounds seconds)
  "The markdown report of the median cells HUNCHENTOOT, OURS and WOO."
  (with-output-to-string (out)
    (format out "Application handlers, one server process each serving them all, wrk -t2 for ~D s a cell, ~
                 the median of ~D round~:P (a round: Hunchentoot's process, then ours~:[~;, then Woo's~]), in ~
                 the order measured; the 100,000 sessions are started by START-SESSION before the first cell ~
                 that names them:~%~%~
                 | cell | Hunchentoot easy-acceptor | parallel-easy-acceptor | ours / Hunchentoot | Woo | ours / Woo |~%~
                 |---|---:|---:|---:|---:|---:|~%" seconds rounds woo)
    (flet ((rate (cell) (and cell (round (getf cell :requests-per-second))))
           (ratio (over under)
             (let ((ratio (and over under (ratio-to (getf over :requests-per-second)
                                                    (getf under :requests-per-second)))))
               (and ratio (ratio-text ratio)))))
      (loop for (name . cell) in ours
            for theirs = (cdr (assoc name hunchentoot :test #'string=))
            for woos = (cdr (assoc name woo :test #'string=))
            do (format out "| ~A | ~:[-~;~:*~D~] | ~D | ~:[-~;~:*~Ax~] | ~:[-~;~:*~D~] | ~:[-~;~:*~Ax~] |~%" name
                       (rate theirs) (rate cell) (ratio cell theirs) (rate woos) (ratio cell woos))))
    (format out "~%Ours, each cell as a fraction of another of ours:~%~%| cell | of | fraction |~%|---|---|---:|~%")
    (loop for (over under) in '(("counter, returning user c10" "plain c10")
                                ("counter, returning user c100" "plain c100")
                                ("counter, returning user, 100,000 sessions c10" "plain c10")
                                ("counter, returning user, 100,000 sessions c100" "plain c100")
                                ("5 KB page with session c100" "5 KB page c100")
                                ("5 KB page with session, 100,000 sessions c100" "5 KB page c100")
                                ("counter, new visitor c100" "plain c100"))
          for ratio = (application-ratio ours over under)
          when ratio
            do (format out "| ~A | ~A | ~A |~%" over under (ratio-text ratio)))
    (let ((failures (loop for (server cells) in (list (list "Hunchentoot" hunchentoot) (list "ours" ours) (list "Woo" woo))
                          append (loop for (name . cell) in cells
                                       for errors = (+ (getf cell :non-2xx) (getf cell :connect-errors)
                                                       (getf cell :read-errors) (getf cell :write-errors)
                                                       (getf cell :timeout-errors))
                                       when (plusp errors) collect (format nil "~A, ~A: ~D" server name errors)))))
      (format out "~%Non-2xx answers and socket errors: ~:[none~;~:*~{~A~^; ~}~].~%" failures))))

(defun run-applications (&key (seconds 3) (rounds 3) core (directory nil))
  "Measure the application cells, ROUNDS rounds, and print the report;
with DIRECTORY (a matrix run's), append it to its summary.md and write
applications.md there.  True when every cell of ours answered only 2xx."
  (let* ((work (uiop:ensure-directory-pathname
                (string-right-trim '(#\Newline) (uiop:run-program '("mktemp" "-d") :output :string))))
         (woo-peer (find "woo" (available-peers) :key (lambda (peer) (getf peer :name)) :test #'string=))
         (woo (and woo-peer (build-peer-core woo-peer (namestring work)))))
    (unless woo-peer
      (announce-missing-peers))
    (unwind-protect
         (let* ((measured (loop for round from 1 to rounds
                                do (format t "~&Application cells, round ~D of ~D~%" round rounds)
                                collect (list (measure-applications :hunchentoot seconds core work)
                                              (measure-applications :parallel seconds core work)
                                              (and woo (measure-woo-applications woo seconds work)))))
                (hunchentoot (median-application-cells (mapcar #'first measured)))
                (ours (median-application-cells (mapcar #'second measured)))
                (woo-cells (and woo (median-application-cells (mapcar #'third measured))))
                (report (application-summary hunchentoot ours woo-cells rounds seconds)))
           (format t "~&~%~A" report)
           (when directory
             (with-open-file (out (merge-pathnames "summary.md" directory) :direction :output :if-exists :append)
               (format out "~%~A" report))
             (with-open-file (out (merge-pathnames "applications.md" directory) :direction :output
                                                                              :if-exists :supersede)
               (write-string report out)))
           (every (lambda (cell) (and (zerop (getf (cdr cell) :non-2xx)) (plusp (getf (cdr cell) :requests-per-second))))
                  ours))
      (uiop:delete-directory-tree work :validate t :if-does-not-exist :ignore))))
