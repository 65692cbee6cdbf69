;;;; The demo's chat page in a real browser: the demo (`make run`) in a
;;;; process of its own, headless Chromium with two pages on /chat.html,
;;;; driven through the DevTools protocol -- itself a websocket, spoken
;;;; with the client of test/websockets.lisp.  A message typed on one page
;;;; must appear on the other.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite browser :in all :description "The demo's websocket chat in headless Chromium.")
(in-suite browser)

(defun chromium-program ()
  (find-if (lambda (name) (ignore-errors (uiop:run-program (list "which" name) :output nil) t))
           '("chromium" "chromium-browser")))

(defun launch-chromium (program debugging-port profile-directory log)
  "Headless Chromium with its DevTools on DEBUGGING-PORT, writing what it
says to LOG."
  (uiop:launch-program
   (list program "--headless=new" "--no-sandbox" "--disable-gpu" "--no-first-run"
         (format nil "--remote-debugging-port=~D" debugging-port)
         (format nil "--user-data-dir=~A" profile-directory)
         "about:blank")
   :output log :error-output :output :if-output-exists :supersede))

(defun log-tail (log &optional (count 15))
  "The last COUNT lines of the file LOG, for a failure's message: what
Chromium or the demo said when a step did not happen."
  (let ((lines (ignore-errors (uiop:read-file-lines log))))
    (format nil "~{~&  ~A~}" (last lines count))))

(defun port-listening-p (port)
  (let ((socket (ignore-errors (connect-to-port port))))
    (when socket
      (usocket:socket-close socket)
      t)))

(defun json-string-field (json name)
  "The string value of the field NAME in the JSON text, unescaped only for \\\" and \\\\."
  (let ((match (nth-value 1 (cl-ppcre:scan-to-strings
                             (format nil "\"~A\"\\s*:\\s*\"((?:[^\"\\\\]|\\\\.)*)\"" name) json))))
    (and match (cl-ppcre:regex-replace-all "\\\\([\"\\\\])" (aref match 0) "\\1"))))

(defun open-devtools-page (debugging-port url)
  "A websocket to the DevTools endpoint of a new page showing URL, or NIL
when Chromium does not open one."
  (ignore-errors (open-devtools-page-or-fail debugging-port url)))

(defun open-devtools-page-or-fail (debugging-port url)
  (let* ((json (drakma:http-request (format nil "http://127.0.0.1:~D/json/new?~A" debugging-port url)
                                    :method :put))
         (endpoint (json-string-field (if (stringp json) json (flex:octets-to-string json)) "webSocketDebuggerUrl"))
         (path (subseq endpoint (search "/devtools/" endpoint)))
         (socket (connect-to-port debugging-port)))
    (send-text socket (websocket-handshake-text path))
    (if (eql 101 (read-reply-head socket))
        socket
        (progn (usocket:socket-close socket) nil))))

(defvar *devtools-id* 0)

(defun evaluate-in-page (socket expression)
  "The value (as a string) of the JavaScript EXPRESSION, which has no double
quote or backslash, evaluated in the page SOCKET speaks to."
  (let ((id (incf *devtools-id*)))
    (send-frame socket 1 (format nil "{\"id\":~D,\"method\":\"Runtime.evaluate\",~
                                      \"params\":{\"expression\":\"String(~A)\",\"returnByValue\":true}}"
                                 id expression))
    (loop (let ((reply (read-text socket :timeout 20)))
            (unless (stringp reply) (return nil))
            (when (search (format nil "\"id\":~D," id) reply)
              (return (json-string-field reply "value")))))))

(defun page-text-eventually (socket expression text)
  "True when EXPRESSION's value in the page contains TEXT within 20 s."
  (wait-until (lambda () (search text (or (evaluate-in-page socket expression) ""))) :timeout 20 :interval 0.2))

(test browser.chat-message-typed-on-one-page-appears-on-another
  (let ((program (chromium-program)))
    (is (not (null program)) "chromium is installed (make test-deps installs it)")
    (when program
      (let* ((port (free-port))
             (debugging-port (free-port))
             (profile (format nil "/tmp/hrt-chromium-~36R/" (random (expt 2 40))))
             (demo-log (format nil "~Ademo.log" profile))
             (chromium-log (format nil "~Achromium.log" profile))
             (demo (progn (ensure-directories-exist profile) (launch-demo port demo-log)))
             (chromium nil)
             (pages '()))
        (unwind-protect
             (progn
               (is (not (null demo)) "the demo serves; it said:~A" (log-tail demo-log))
               (setf chromium (launch-chromium program debugging-port profile chromium-log))
               (is (wait-until (lambda () (port-listening-p debugging-port)) :timeout 120)
                   "chromium listens for DevTools; it said:~A" (log-tail chromium-log))
               (let ((url (format nil "http://127.0.0.1:~D/chat.html" port)))
                 (flet ((page ()
                          (let ((socket nil))
                            (wait-until (lambda () (setf socket (open-devtools-page debugging-port url)))
                                        :timeout 30 :interval 0.5)
                            socket)))
                   (setf pages (list (page) (page)))))
               (is (every #'identity pages) "two pages open; chromium said:~A" (log-tail chromium-log))
               (when (every #'identity pages)
                 (destructuring-bind (one two) pages
                   (is (page-text-eventually one "document.getElementById('status').textContent" "Connected")
                       "page one connects; the demo said:~A" (log-tail demo-log))
                   (is (page-text-eventually two "document.getElementById('status').textContent" "Connected")
                       "page two connects; the demo said:~A" (log-tail demo-log))
                   (evaluate-in-page one "(document.getElementById('text').value = 'hello from page one', document.getElementById('form').requestSubmit(), 1)")
                   (is (page-text-eventually two "document.getElementById('messages').textContent" "hello from page one")
                       "the message reached the other page")
                   (is (page-text-eventually one "document.getElementById('messages').textContent" "hello from page one")
                       "and its own"))))
          (mapc #'usocket:socket-close (remove nil pages))
          (when chromium (stop-process chromium))
          (when demo (stop-process demo))
          (uiop:delete-directory-tree (uiop:ensure-directory-pathname profile) :validate t :if-does-not-exist :ignore))))))
