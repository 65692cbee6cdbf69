;;;; The access log the engine writes when the acceptor logs as Hunchentoot
;;;; does: Hunchentoot's entry, octet for octet, kept and written in batches,
;;;; a renamed file followed, a file that cannot be written never a request
;;;; lost.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite access-log :in all :description "The access log, written by the engine in batches.")
(in-suite access-log)

(defun text (&rest parts)
  "The string of PARTS, strings and code points: the tests' source stays ASCII."
  (format nil "~{~A~}" (mapcar (lambda (part) (if (integerp part) (code-char part) part)) parts)))

(defun hunchentoots-entry (remote-addr forwarded-for user time method script-name query-string protocol
                           return-code content-length referer user-agent)
  "The entry Hunchentoot's ACCEPTOR-LOG-ACCESS writes for these values: its
format string, applied to them."
  (flex:string-to-octets
   (format nil "~:[-~@[ (~A)~]~;~:*~A~@[ (~A)~]~] ~:[-~;~:*~A~] [~A] \"~A ~A~@[?~A~] ~
                    ~A\" ~D ~:[-~;~:*~D~] \"~:[-~;~:*~A~]\" \"~:[-~;~:*~A~]\"~%"
           remote-addr forwarded-for user time method script-name query-string protocol
           return-code content-length referer user-agent)
   :external-format :utf-8))

(defun engines-entry (&rest values)
  (let ((head (hrt::make-reply-head)))
    (destructuring-bind (remote-addr forwarded-for user time &rest rest) values
      (apply #'hrt::push-access-log-line head remote-addr forwarded-for user
             (flex:string-to-octets time :external-format :utf-8) rest))
    (subseq (hrt::reply-head-octets head) 0 (hrt::reply-head-end head))))

(test access-log.entries-are-hunchentoots-octet-for-octet
  (dolist (values `(("127.0.0.1" nil nil "2026-12-07 21:05:09" :get "/test/yo" nil :http/1.1 200 4 nil nil)
                    ("10.1.2.3" "203.0.113.9, 10.0.0.1" "alice" "2026-01-01 00:00:00" :post "/form" "a=1&b=%C3%A9"
                     :http/1.0 302 nil "https://example.org/page?x=\"y\"" "Mozilla/5.0 (X11; Linux) \"quoted\"")
                    (nil "198.51.100.7" "" "2026-12-07 21:05:09" :head ,(text "/caf" #xe9 "/" #x65e5 #x672c) ,(text "q=" #xfc) :http/2 404 0
                     "" "curl/7.88.1")
                    (nil nil nil "2026-12-07 21:05:09" :- "-" nil :- 400 nil nil nil)
                    ("::1" nil "bob:colon" "2026-12-07 21:05:09" "PATCH" "/x" "" "HTTP/1.1" 204 123456789
                     nil ,(text "agent " #x1F600))))
    (let ((expected (apply #'hunchentoots-entry values))
          (built (apply #'engines-entry values)))
      (is (equalp expected built) "for ~S:~%  Hunchentoot: ~S~%  ours:        ~S"
          values (flex:octets-to-string expected :external-format :utf-8)
          (flex:octets-to-string built :external-format :utf-8)))))

(test access-log.control-characters-are-written-as-escapes
  (let ((entry (flex:octets-to-string (engines-entry "127.0.0.1" nil nil "2026-12-07 21:05:09" :get
                                                     (format nil "/a~Cb~Cc" #\Newline #\Return) nil :http/1.1 404 nil
                                                     nil (format nil "x~Cy~C" #\Tab (code-char 127)))
                                      :external-format :utf-8)))
    (is (eql 1 (count #\Newline entry)) "one line: ~S" entry)
    (is (search "/a\\x0Ab\\x0Dc" entry) "the path's LF and CR as \\xHH: ~S" entry)
    (is (search "\"x\\x09y\\x7F\"" entry) "the agent's TAB and DEL as \\xHH: ~S" entry)))

(defclass hunchentoot-logged-acceptor (parallel-easy-acceptor) ()
  (:documentation "An acceptor whose access log Hunchentoot's method writes, as it
does whenever an application has a method of its own."))

(defmethod ht:acceptor-log-access :around ((acceptor hunchentoot-logged-acceptor) &key return-code)
  (declare (ignore return-code))
  (call-next-method))

(defun masked-log-lines (file)
  "FILE's lines, with each time replaced by [T]: the two logs are written
in different seconds."
  (mapcar (lambda (line) (cl-ppcre:regex-replace "\\[\\d{4}-\\d\\d-\\d\\d \\d\\d:\\d\\d:\\d\\d\\]" line "[T]"))
          (uiop:read-file-lines file :external-format :utf-8)))

(defparameter *logged-requests*
  (list (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" "")
        (crlf-lines "GET /test/params?a=1&b=%C3%A9&c HTTP/1.1" "Host: localhost"
                    "Referer: https://example.org/from?x=\"y\"" "User-Agent: Mozilla/5.0 (X11; Linux) \"q\"" "")
        (crlf-lines "GET /nothing-here HTTP/1.1" "Host: localhost" "X-Forwarded-For: 203.0.113.9, 10.0.0.1" "")
        (crlf-lines "HEAD /test/yo HTTP/1.1" "Host: localhost" "")
        (crlf-lines "GET /test/yo HTTP/1.1" "Host: localhost" "Authorization: Basic dXNlcjpwYXNz" "")
        (crlf-lines "GET /caf%C3%A9/%E6%97%A5 HTTP/1.1" "Host: localhost" (text "User-Agent: " #xe9 "t" #xe9) "")
        (crlf-lines "POST /test/params HTTP/1.1" "Host: localhost" "Content-Type: application/x-www-form-urlencoded"
                    "Content-Length: 7" "" "v=1&w=2")
        (crlf-lines "GET /test/yo HTTP/1.0" "")))

(test access-log.same-lines-as-hunchentoots-method
  (flet ((log-of (class)
           (let ((file (uiop:tmpize-pathname (merge-pathnames "access-log.log" (uiop:temporary-directory)))))
             (with-server (server (make-server class :access-log-destination file))
               (dolist (request *logged-requests*)
                 (with-connection (socket server)
                   (send-text socket request)
                   (is-true (if (search "HEAD " request :end2 5)
                                (wait-until (lambda () (usocket:wait-for-input socket :timeout 0 :ready-only t)))
                                (read-response socket))))))
             (prog1 (masked-log-lines file)
               (delete-file file)))))
    (let ((ours (log-of 'parallel-easy-acceptor))
          (hunchentoots (log-of 'hunchentoot-logged-acceptor))
          (hunchentoots-acceptor (log-of 'ht:easy-acceptor)))
      (is (= (length *logged-requests*) (length ours)) "one line a request: ~S" ours)
      (is (equal hunchentoots ours) "~{~%  ~A~}~%and Hunchentoot's method:~{~%  ~A~}" ours hunchentoots)
      (is (equal hunchentoots-acceptor ours) "~{~%  ~A~}~%and Hunchentoot's acceptor:~{~%  ~A~}"
          ours hunchentoots-acceptor))))

(test access-log.entries-written-while-the-server-runs
  ;; Kept, they are written within a tenth of a second: not only at STOP.
  (uiop:with-temporary-file (:pathname file)
    (with-server (server (make-server 'parallel-easy-acceptor :access-log-destination file))
      (is (eql 200 (http-get server "/test/yo")))
      (is (wait-until (lambda () (eql 1 (log-lines-matching file "GET /test/yo HTTP/1.1"))) :timeout 5)
          "the entry is in the file while the server runs"))))

(test access-log.a-stream-destination-gets-every-entry
  ;; Read once the server has stopped: a string stream is for one thread.
  (let* ((stream (make-string-output-stream))
         (text (progn
                 (with-server (server (make-server 'parallel-easy-acceptor :access-log-destination stream))
                   (dotimes (i 20)
                     (is (eql 200 (http-get server (format nil "/test/yo?n=~D" i))))))
                 (get-output-stream-string stream))))
    (is (eql 20 (count #\Newline text)) "20 lines: ~S" text)
    (dotimes (i 20)
      (is (search (format nil "GET /test/yo?n=~D HTTP/1.1\" 200 4" i) text) "request ~D's line" i))))

(defun h2load-paced (server paths rate)
  "Run h2load over HTTP/1.1 against SERVER for each of PATHS once, in order
on one kept-alive connection, RATE requests a second: its report."
  (uiop:with-temporary-file (:stream out :pathname uris :direction :output :keep t)
    (dolist (path paths)
      (format out "~A~%" (url server path)))
    :close-stream
    (unwind-protect
         (uiop:run-program (list "timeout" "60" "h2load" "--h1" "-n" (princ-to-string (length paths))
                                 "-c" "1" "--rps" (princ-to-string rate)
                                 "-i" (namestring uris))
                           :output :string :ignore-error-status t)
      (delete-file uris))))

(test access-log.a-renamed-file-is-followed-and-nothing-is-lost
  ;; logrotate's way: the file renamed under load (1,000 requests/s for 5
  ;; s), a new one made at the same name by the next write.
  (let* ((directory (make-scratch-folder))
         (file (merge-pathnames "access.log" directory))
         (rotated (merge-pathnames "access.log.1" directory))
         (count 5000))
    (unwind-protect
         (progn
           (with-server (server (make-server 'parallel-easy-acceptor :access-log-destination file))
             (let ((load (in-thread (lambda ()
                                      (h2load-paced server (loop for i below count collect (format nil "/test/yo?n=~D" i))
                                                    1000)))))
               (is (wait-until (lambda () (<= 2000 (log-lines-matching file "GET /test/yo?n="))) :timeout 30)
                   "the load ran")
               (rename-file file rotated)
               (let ((report (first (funcall load))))
                 (is (search "5000 succeeded" report) "h2load: ~A" report))))
           (let ((numbers (make-hash-table))
                 (old (uiop:read-file-lines rotated))
                 (new (uiop:read-file-lines file)))
             (dolist (line (append old new))
               (let ((match (nth-value 1 (cl-ppcre:scan-to-strings "GET /test/yo\\?n=(\\d+) " line))))
                 (when match
                   (incf (gethash (parse-integer (aref match 0)) numbers 0)))))
             (is (< 0 (length old)) "lines before the rename stayed in the renamed file")
             (is (< 0 (length new)) "lines after the rename went to a new file")
             (is (= count (hash-table-count numbers)) "~D of ~D requests logged" (hash-table-count numbers) count)
             (is (loop for n being the hash-values of numbers always (eql 1 n)) "no request logged twice")))
      (uiop:delete-directory-tree (uiop:ensure-directory-pathname directory) :validate t))))

(test access-log.an-unwritable-file-costs-no-request-and-one-message
  ;; A directory that is not there (root writes anywhere else): every
  ;; request answered, one message, the entries counted as lost; written
  ;; again once the directory is made, with a message saying how many
  ;; were lost.
  (let* ((directory (make-scratch-folder))
         (file (merge-pathnames "not-yet/access.log" directory))
         (messages (merge-pathnames "messages.log" directory)))
    (unwind-protect
         (progn
           (with-server (server (make-server 'parallel-easy-acceptor :access-log-destination file
                                                                     :message-log-destination messages))
             (dotimes (i 200)
               (is (eql 200 (http-get server "/test/yo"))))
             (is (wait-until (lambda () (eql 200 (hrt::access-log-lost-entries (hrt::find-access-log file))))
                             :timeout 5)
                 "200 entries counted as lost: ~D" (hrt::access-log-lost-entries (hrt::find-access-log file)))
             (ensure-directories-exist file)
             (is (eql 200 (http-get server "/test/yo?again")))
             (is (wait-until (lambda () (eql 1 (log-lines-matching file "GET /test/yo?again "))) :timeout 5)))
           (is (eql 1 (log-lines-matching messages "cannot be written")) "one message for the failure")
           (is (eql 1 (log-lines-matching messages "is written again; 200 entries were lost"))
               "one message when written again"))
      (uiop:delete-directory-tree (uiop:ensure-directory-pathname directory) :validate t))))

(defun json-log-fields (file keys)
  "For each line of FILE, read as JSON by Python's json module, the values of
KEYS as strings, a line feed in them as <LF> and a tab as <TAB>, null as
\"?null\", a key not there as \"?missing\"; a line that is not a JSON
object as (\"?not-json\" line)."
  (mapcar (lambda (line) (uiop:split-string line :separator (string (code-char 31))))
          (uiop:run-program (list* "/usr/bin/python3" "-c"
                                   "import json, sys
sys.stdout.reconfigure(encoding='utf-8')
for line in open(sys.argv[1], encoding='utf-8'):
    try:
        entry = json.loads(line)
        values = [entry.get(key, '?missing') for key in sys.argv[2:]]
    except ValueError:
        values = ['?not-json', line]
    print('\\x1f'.join('?null' if value is None else str(value).replace('\\n', '<LF>').replace('\\t', '<TAB>')
                        for value in values))"
                                   (namestring file) keys)
                            :output :lines :external-format :utf-8)))

(test access-log.json-entries-are-one-object-a-line
  (uiop:with-temporary-file (:pathname file)
    (with-server (server (make-server 'parallel-easy-acceptor :access-log-destination file :access-log-format :json))
      (with-connection (socket server)
        (send-text socket (crlf-lines "GET /test/params?a=%22q%22&b=%5C HTTP/1.1" "Host: localhost"
                                      (text "User-Agent: agent \"quoted\" \\ " #xe9 "t" #xe9 " " #x1F600)
                                      "X-Forwarded-For: 203.0.113.9" ""))
        (is (eql 200 (read-response socket)))
        (send-text socket (crlf-lines "GET /caf%C3%A9%0A%09x HTTP/1.1" "Host: localhost" "Referer: r" ""))
        (is (eql 404 (read-response socket)))))
    (let ((entries (json-log-fields file '("time" "remote_addr" "forwarded_for" "user" "method" "path" "query"
                                           "protocol" "status" "octets" "duration_us" "referer" "user_agent"))))
      (is (= 2 (length entries)) "two entries: ~S" entries)
      (destructuring-bind (&optional first second) entries
        (is (cl-ppcre:scan "^\\d{4}-\\d\\d-\\d\\dT\\d\\d:\\d\\d:\\d\\dZ$" (first first)) "a UTC time: ~S" first)
        (is (equal '("127.0.0.1" "203.0.113.9" "?null" "GET" "/test/params" "a=%22q%22&b=%5C" "HTTP/1.1" "200")
                   (subseq first 1 9))
            "the request's fields: ~S" first)
        (is (every #'digit-char-p (nth 10 first)) "a duration in microseconds: ~S" (nth 10 first))
        ;; Header values are read as Latin-1, as Hunchentoot reads them.
        (is (equal (list "?null" (flex:octets-to-string
                                  (flex:string-to-octets (text "agent \"quoted\" \\ " #xe9 "t" #xe9 " " #x1F600)
                                                         :external-format :utf-8)
                                  :external-format :latin-1))
                   (subseq first 11))
            "~S" first)
        (is (equal (text "/caf" #xe9 "<LF><TAB>x") (nth 5 second))
            "the path's characters, control ones included, read back: ~S" (nth 5 second))
        (is (equal '("404" "r") (list (nth 8 second) (nth 11 second))) "~S" second)))))
