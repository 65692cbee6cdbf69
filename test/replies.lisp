;;;; Replies written as octets by the engine, compared byte for byte with
;;;; the replies Hunchentoot's own EASY-ACCEPTOR writes for the same
;;;; requests: only the Date value and the Keep-Alive timeout (which names
;;;; :KEEP-ALIVE-TIMEOUT here, :READ-TIMEOUT there) may differ.

(in-package #:hunchentoot-recycling-taskmaster-test)

(def-suite replies :in all :description "Replies, the same octets as Hunchentoot's.")
(in-suite replies)

(ht:define-easy-handler (test-reply-headers :uri "/test/reply-headers") ()
  (setf (ht:return-code*) ht:+http-created+
        (ht:content-type*) "text/plain; charset=utf-8"
        (ht:header-out :x-made-up) "a value"
        (ht:header-out "X-Named-By-String") "another"
        (ht:header-out :cache-control) "no-cache"
        (ht:header-out :x-number) 42
        (ht:header-out :x-symbol) :some-symbol
        (ht:header-out :location) "/elsewhere")
  (ht:set-cookie "flavour" :value "chocolate" :path "/" :http-only t)
  (ht:set-cookie "size" :value "large" :max-age 60 :secure t)
  "headers set")

(ht:define-easy-handler (test-latin-1 :uri "/test/latin-1") ()
  (setf (ht:content-type*) "text/plain"
        (ht:reply-external-format*) (flex:make-external-format :latin-1 :eol-style :lf))
  (format nil "caf~C" (code-char 233)))

(ht:define-easy-handler (test-ascii-text :uri "/test/ascii-text") ((length :parameter-type 'integer))
  ;; About the length of a body the engine writes in the head's buffer.
  (setf (ht:content-type*) "text/plain")
  (make-string length :initial-element #\a))

(ht:define-easy-handler (test-octets :uri "/test/octets") ()
  (setf (ht:content-type*) "application/octet-stream")
  (coerce #(0 1 2 3 255) '(vector (unsigned-byte 8))))

(ht:define-easy-handler (test-not-modified :uri "/test/not-modified") ()
  (ht:handle-if-modified-since (encode-universal-time 0 0 0 1 1 2020 0))
  (setf (ht:header-out :last-modified) (ht:rfc-1123-date (encode-universal-time 0 0 0 1 1 2020 0)))
  "modified")

(ht:define-easy-handler (test-classes :uri "/test/classes") ()
  (setf (ht:content-type*) "text/plain")
  (format nil "~(~A ~A~)" (type-of ht:*request*) (type-of ht:*reply*)))

(defclass test-request (ht:request) ())

(defclass test-reply (ht:reply) ())

(defmethod initialize-instance :after ((reply test-reply) &key)
  (setf (ht:header-out :x-from-reply-class reply) "yes"))

(defclass reply-with-default-initargs (parallel-reply)
  ((tag :initarg :tag :initform :fresh :reader reply-tag))
  (:default-initargs :tag (list :default-initarg))
  (:documentation "A reply class of a user's whose slot a default initarg fills."))

(ht:define-easy-handler (test-reply-fields :uri "/test/reply-fields") ()
  (let ((reply ht:*reply*)
        (*print-pretty* nil))
    (prog1 (prin1-to-string
            (list :class (let ((class (ht:acceptor-reply-class ht:*acceptor*)))
                           (if (typep reply class) class (type-of reply)))
                  :headers (ht:headers-out* reply)
                  :content-type (ht:content-type* reply)
                  :content-length (ht:content-length* reply)
                  :return-code (ht:return-code* reply)
                  :external-format (flex:external-format-name (ht:reply-external-format* reply))
                  :cookies (ht:cookies-out* reply)
                  :tag (and (slot-exists-p reply 'tag) (slot-value reply 'tag))))
      (setf (ht:content-type*) "text/plain"))))

(defun reply-complete-p (text head-request-p)
  "True when TEXT holds a whole reply: its head, then the body its
Content-Length, chunked coding or status says (none for HEAD and 304)."
  (let ((head-end (search (coerce '(#\Return #\Linefeed #\Return #\Linefeed) 'string) text)))
    (when head-end
      (let* ((head (subseq text 0 head-end))
             (body-start (+ head-end 4))
             (length-match (nth-value 1 (cl-ppcre:scan-to-strings "(?im)^content-length:\\s*(\\d+)" head))))
        (cond ((or head-request-p (search " 304 " head)) t)
              (length-match (<= (+ body-start (parse-integer (aref length-match 0))) (length text)))
              ((cl-ppcre:scan "(?im)^transfer-encoding:\\s*chunked" head)
               (search (coerce '(#\Return #\Linefeed #\0 #\Return #\Linefeed #\Return #\Linefeed) 'string)
                       text :start2 (- body-start 2)))
              (t nil))))))

(defun read-whole-reply (socket head-request-p &key (timeout 10))
  "The octets of one reply read from SOCKET, as a Latin-1 string: up to
its end (REPLY-COMPLETE-P), the connection's end or TIMEOUT seconds."
  (let ((stream (usocket:socket-stream socket))
        (text (make-array 0 :element-type 'character :adjustable t :fill-pointer t))
        (deadline (+ (get-internal-real-time) (* timeout internal-time-units-per-second))))
    (loop until (or (reply-complete-p text head-request-p)
                    (> (get-internal-real-time) deadline))
          do (when (usocket:wait-for-input socket :timeout 0.1 :ready-only t)
               (let ((octet (read-byte stream nil)))
                 (if octet (vector-push-extend (code-char octet) text) (return)))))
    (coerce text 'simple-string)))

(defun normalized-reply (text)
  "TEXT with the Date value, the Keep-Alive timeout and the port a status
page names blanked."
  (cl-ppcre:regex-replace-all "(?m)^(Date: )[^\\r]*|(Keep-Alive: timeout=)\\d+|(\\(port )\\d+" text "\\1\\2\\3*"))

(defun replies-of (class requests &rest initargs)
  "The normalized replies an acceptor of CLASS gives to each of REQUESTS,
each sent on a connection of its own."
  (with-server (server (apply #'make-server class initargs))
    (loop for request in requests
          collect (with-connection (socket server)
                    (send-text socket request)
                    (normalized-reply (read-whole-reply socket (eql 0 (search "HEAD " request))))))))

(defun check-same-replies (requests &rest initargs)
  (loop for request in requests
        for theirs in (apply #'replies-of 'ht:easy-acceptor requests initargs)
        for ours in (apply #'replies-of 'parallel-easy-acceptor requests initargs)
        do (is (equal theirs ours) "~S~%Hunchentoot's reply:~%~A~%ours:~%~A" request theirs ours)))

;;; The text functions of the reply and the Host check, over every kind of
;;; string a handler or the head's parser may give (WITH-STRING-KIND).

(defun every-kind-of-string (text)
  "TEXT as a (SIMPLE-ARRAY CHARACTER (*)), as a SIMPLE-BASE-STRING when its
characters are base characters, and as a string with a fill pointer."
  (append (list (coerce text '(simple-array character (*))))
          (when (every (lambda (char) (typep char 'base-char)) text)
            (list (coerce text 'simple-base-string)))
          (list (make-array (length text) :element-type 'character :initial-contents text
                                          :adjustable t :fill-pointer t))))

(defun pushed-text-octets (string)
  "The octets PUSH-TEXT writes for STRING into a new reply head."
  (let ((head (hunchentoot-recycling-taskmaster::make-reply-head)))
    (hunchentoot-recycling-taskmaster::push-text string head)
    (subseq (hunchentoot-recycling-taskmaster::reply-head-octets head)
            0 (hunchentoot-recycling-taskmaster::reply-head-end head))))

(test string-kinds.same-answers-for-every-kind-of-string
  (dolist (text (list "Hey!" "" "example.org:8080" "[::1]:80" "a b" "x:80a"
                      (format nil "split~C~Cline" #\Return #\Newline) (format nil "nul~C" (code-char 0))
                      (format nil "caf~C" (code-char 233)) (format nil "~C-calculus" (code-char 955))))
    (let ((ascii-p (every (lambda (char) (< (char-code char) 128)) text))
          (codes (map '(vector (unsigned-byte 8)) (lambda (char) (min (char-code char) 255)) text))
          (latin-1 (map '(vector (unsigned-byte 8))
                        (lambda (char) (if (< (char-code char) 256) (char-code char) (char-code #\?)))
                        text))
          (unsafe-p (some (lambda (char) (member (char-code char) '(0 10 13))) text))
          (authority-p (hunchentoot-recycling-taskmaster::valid-authority-p
                        (coerce text '(simple-array character (*))))))
      (dolist (string (every-kind-of-string text))
        (is (eq ascii-p (hunchentoot-recycling-taskmaster::ascii-string-p string)) "ascii-string-p of ~S, a ~S" text (type-of string))
        (when ascii-p
          (is (equalp codes (hunchentoot-recycling-taskmaster::ascii-string-octets string))
              "ascii-string-octets of ~S, a ~S" text (type-of string)))
        (is (equalp latin-1 (pushed-text-octets string)) "push-text of ~S, a ~S" text (type-of string))
        (is (eq (and unsafe-p t) (and (hunchentoot-recycling-taskmaster::unsafe-header-text-p string) t))
            "unsafe-header-text-p of ~S, a ~S" text (type-of string))
        (is (eq authority-p (hunchentoot-recycling-taskmaster::valid-authority-p string))
            "valid-authority-p of ~S, a ~S" text (type-of string)))))
  ;; The Host check itself, on the strings above.
  (is-true (hunchentoot-recycling-taskmaster::valid-authority-p "example.org:8080"))
  (is-true (hunchentoot-recycling-taskmaster::valid-authority-p "[::1]:80"))
  (is-false (hunchentoot-recycling-taskmaster::valid-authority-p "a b"))
  (is-false (hunchentoot-recycling-taskmaster::valid-authority-p "x:80a")))

(test replies.same-octets-as-hunchentoot
  (check-same-replies
   (list (get-request "/test/yo")
         (get-request "/test/reply-headers")
         (crlf-lines "HEAD /test/reply-headers HTTP/1.1" "Host: localhost" "")
         (get-request "/test/not-modified" "If-Modified-Since: Wed, 01 Jan 2020 00:00:00 GMT")
         (get-request "/test/not-modified" "If-Modified-Since: Tue, 31 Dec 2019 00:00:00 GMT")
         (get-request "/test/latin-1")
         (get-request "/test/utf-8?name=%E3%81%82")
         (get-request "/test/octets")
         (get-request "/test/ascii-text?length=16384")
         (get-request "/test/ascii-text?length=16385")
         (crlf-lines "HEAD /test/ascii-text?length=10 HTTP/1.1" "Host: localhost" "")
         (get-request "/test/no-such-page")
         (get-request "/test/yo" "Connection: close")
         (crlf-lines "GET /test/yo HTTP/1.0" "Connection: keep-alive" "")
         (crlf-lines "GET /test/yo HTTP/1.0" "")
         (get-request "/test/chunked-reply")
         (concatenate 'string
                      (crlf-lines "POST /test/body HTTP/1.1" "Host: localhost" "Content-Length: 5" "")
                      "hello")
         ;; A chunked body: the reply is written to the connection's stream.
         (crlf-lines "POST /test/body HTTP/1.1" "Host: localhost" "Transfer-Encoding: chunked" ""
                     "5" "hello" "0" ""))))

(test replies.keep-alive-read-as-hunchentoot-reads-it
  (dolist (persistent '(t nil))
    (let ((ht:*acceptor* (make-instance 'ht:acceptor :persistent-connections-p persistent)))
      (dolist (protocol '(:http/1.1 :http/1.0))
        (dolist (value '(nil "close" "Close" "keep-alive" "Keep-Alive" "upgrade, close" "close,upgrade"
                         "Upgrade ,  Keep-Alive" "keep-alive , close" " close" "close " "close ,"
                         ",close" "closed" "xclose" "keep-alive-x" "a,,close" "a ,	 , keep-alive"
                         "te, keep-alive,close" "" "," "close, keep-alive"))
          (let ((request (allocate-instance (find-class 'ht:request))))
            (setf (slot-value request 'ht::headers-in) (and value (list (cons :connection value)))
                  (slot-value request 'ht::server-protocol) protocol)
            (flet ((truths (values) (mapcar (lambda (value) (and value t)) values)))
              ;; Hunchentoot's two answers, then the protocol read for them.
              (is (equal (append (truths (multiple-value-list (ht::keep-alive-p request))) (list protocol))
                         (multiple-value-bind (keep-alive-p requested-p read-protocol)
                             (hrt::keep-alive-reply-p request)
                           (append (truths (list keep-alive-p requested-p)) (list read-protocol))))
                  "~S ~S persistent ~S" protocol value persistent))))))))

(defun header-line-text (name value &optional value-octets)
  "The header line PUSH-HEADER-LINE writes, as a string."
  (let ((head (hrt::make-reply-head)))
    (hrt::push-header-line name value head value-octets)
    (map 'string #'code-char (subseq (hrt::reply-head-octets head) 0 (hrt::reply-head-end head)))))

(test replies.header-lines-as-hunchentoot-writes-them
  (flet ((crlf-line (format &rest arguments)
           (format nil "~?~C~C" format arguments #\Return #\Linefeed)))
    (dolist (name '(:content-length :content-type :date :server :connection :keep-alive :set-cookie :x-made-up))
      (is (string= (crlf-line "~A: v" (chunga:as-capitalized-string name)) (header-line-text name "v"))
          "~S" name))
    (is (string= (crlf-line "Set-Cookie: a=b") (header-line-text "Set-Cookie" "a=b")))
    (is (string= (crlf-line "Content-Length: 1024") (header-line-text :content-length 1024)))
    (is (string= (crlf-line "X-Latin: ~C?" (code-char 233)) (header-line-text :x-latin (coerce '(#\LATIN_SMALL_LETTER_E_WITH_ACUTE #\EURO_SIGN) 'string))))))

(defun made-value-and-octets (make octets-of)
  "A header value MAKE made and OCTETS-OF's octets for it, made again
should the second turn, or another thread's value replace it, in between."
  (loop repeat 100
        do (let* ((value (funcall make))
                  (octets (funcall octets-of value)))
             (when octets
               (return (values value octets))))))

(test replies.made-header-values-written-from-their-octets
  (let ((external-format (flex:make-external-format :utf-8 :eol-style :lf))
        (unsafe (format nil "a~Cb" #\Return)))
    (dolist (made (list (multiple-value-list
                         (made-value-and-octets #'hrt::date-header-value #'hrt::date-header-octets))
                        (multiple-value-list
                         (made-value-and-octets (lambda ()
                                                  (hrt::content-type-with-charset
                                                   (format nil "text/x-~D" (random 1000000)) external-format))
                                                #'hrt::charset-added-content-type-octets))))
      (destructuring-bind (&optional value octets) made
        (is (stringp value) "no octets made")
        (when value
          (is (string= (header-line-text :x value) (header-line-text :x value octets)) "~S" value)
          ;; An equal string the engine did not make is written from its characters.
          (is (null (hrt::date-header-octets (copy-seq value))))
          (is (null (hrt::charset-added-content-type-octets (copy-seq value)))))))
    (is (null (hrt::header-text-octets unsafe)))
    (is (hrt::push-header-line :x unsafe (hrt::make-reply-head)) "a value with a CR not told")))

(defun pushed-reply-head-text (head return-code headers &optional omitted)
  "The head PUSH-REPLY-HEAD makes in HEAD for RETURN-CODE, HEADERS and the
current reply's cookies, as a string."
  (hrt::push-reply-head return-code headers head omitted)
  (map 'string #'code-char (subseq (hrt::reply-head-octets head) 0 (hrt::reply-head-end head))))

(test replies.remembered-head-copied-only-for-the-same-reply
  ;; Each reply of the sequence is built in one kept head and in a new one:
  ;; the same octets, whatever was kept from the reply before.
  (let* ((ht:*reply* (make-instance 'ht:reply))
         (date (hrt::date-header-value))
         (close (hrt::connection-header-value :close))
         (kept (hrt::make-reply-head))
         (made '((200 ((:content-length . 4) (:date . :date) (:connection . :close)))
                 (200 ((:content-length . 4) (:date . :date) (:connection . :close)))
                 (200 ((:content-length . 5) (:date . :date) (:connection . :close)))
                 (404 ((:content-length . 5) (:date . :date) (:connection . :close)))
                 (404 ((:content-length . 5) (:date . :date)))
                 (404 ((:content-length . 5) (:date . :date) (:x-extra . 7)))
                 (404 ((:content-length . 5) (:date . :date) (:connection . nil)))
                 (404 ((:content-length . 5) (:date . :copied-date)))
                 (404 ((:content-length . 5) (:date . :date)) (:date))
                 (404 ((:content-length . 5) (:date . :date)) () :cookie)
                 (404 ((:content-length . 5) (:date . :date))))))
    (loop for (code entries omitted cookie) in made
          for number from 1
          do (let ((headers (loop for (name . value) in entries
                                  collect (cons name (case value
                                                       (:date date)
                                                       (:copied-date (copy-seq date))
                                                       (:close close)
                                                       (t value))))))
               (setf (ht:cookies-out ht:*reply*) '())
               (when cookie
                 (ht:set-cookie "a" :value "b"))
               (is (string= (pushed-reply-head-text (hrt::make-reply-head) code headers omitted)
                            (pushed-reply-head-text kept code headers omitted))
                   "reply ~D" number)))
    ;; The second reply was the first's copied: nothing was kept anew.
    (let ((headers (list (cons :content-length 4) (cons :date date))))
      (pushed-reply-head-text kept 200 headers)
      (let ((octets (hrt::reply-head-remembered-octets kept)))
        (is-true octets "a head of made values not kept")
        (pushed-reply-head-text kept 200 (copy-alist headers))
        (is (eq octets (hrt::reply-head-remembered-octets kept)) "the same head built again")
        ;; One not the engine's is neither kept nor copied.
        (is (search "X-Mine: v" (pushed-reply-head-text kept 200 (list (cons :x-mine (copy-seq "v"))))))
        (is (eq octets (hrt::reply-head-remembered-octets kept)) "a value not the engine's kept")))))

(test replies.date-header-turns-with-the-second
  ;; Within a tick or two of the coarse clock the value names the new second.
  (let ((second (get-universal-time)))
    (hrt::date-header-value)
    (loop while (= (get-universal-time) second) do (sleep 0.001))
    (let ((next (ht:rfc-1123-date (1+ second)))
          (deadline (+ (get-internal-real-time) (floor internal-time-units-per-second 20))))
      (loop until (or (string= (hrt::date-header-value) next)
                      (> (get-internal-real-time) deadline))
            do (sleep 0.001))
      (is (string= next (hrt::date-header-value))))))

(test replies.handler-error-page-is-the-same
  (let ((ht:*show-lisp-errors-p* nil))
    (check-same-replies (list (get-request "/test/error")))))

(test replies.request-and-reply-subclasses-are-used
  (check-same-replies (list (get-request "/test/classes"))
                      :request-class 'test-request :reply-class 'test-reply))

(test replies.reply-objects-same-as-hunchentoots
  (dolist (class '(ht:reply reply-with-default-initargs test-reply))
    (check-same-replies (list (get-request "/test/reply-fields")) :reply-class class))
  (let ((default ht:*default-content-type*))
    ;; Set, not bound: the workers read the global value.
    (setf ht:*default-content-type* "text/x-other")
    (unwind-protect (check-same-replies (list (get-request "/test/reply-fields")))
      (setf ht:*default-content-type* default))))

;;; Header values that would end their line early: a handler that copies a
;;; client's text into a header, a cookie or a redirect target.

(defparameter *unsafe-values*
  (list (format nil "a~CInjected: 1" #\Return)
        (format nil "a~CInjected: 1" #\Linefeed)
        (format nil "a~C~CInjected: 1" #\Return #\Linefeed)
        (format nil "a~CInjected: 1" (code-char 0)))
  "Values with a CR, a LF, a CRLF and a NUL before an injected header.")

(ht:define-easy-handler (test-echo-header :uri "/test/echo-header") (kind (index :parameter-type 'integer))
  (let ((value (nth index *unsafe-values*)))
    (setf (ht:content-type*) "text/plain")
    (cond ((equal kind "header") (setf (ht:header-out :x-echo) value) "echoed")
          ((equal kind "cookie") (ht:set-cookie "echo" :value "v" :path value) "echoed")
          ((equal kind "redirect") (ht:redirect (format nil "/somewhere?~A" value)))
          ((equal kind "streamed")
           (setf (ht:header-out :x-echo) value)
           (let ((stream (ht:send-headers)))
             (write-sequence (flex:string-to-octets "streamed") stream)
             nil)))))

(defun unsafe-reply (server kind index)
  "The whole reply, as a Latin-1 string, SERVER sends for KIND and value INDEX."
  (with-connection (socket server)
    (send-text socket (get-request (format nil "/test/echo-header?kind=~A&index=~D" kind index)))
    (read-whole-reply socket nil)))

(test replies.unsafe-header-values-never-reach-the-wire
  (uiop:with-temporary-file (:pathname log)
    (with-server (server (make-server 'parallel-easy-acceptor :message-log-destination log))
      (dolist (kind '("header" "cookie" "redirect" "streamed"))
        (dotimes (index (length *unsafe-values*))
          (let* ((reply (unsafe-reply server kind index))
                 (head (subseq reply 0 (or (search (crlf-lines "" "") reply) (length reply)))))
            (is (eql 0 (search "HTTP/1.1 500" reply)) "~A ~D: ~S" kind index reply)
            (is (not (search "Injected" reply)) "~A ~D: the value reached the wire: ~S" kind index reply)
            (is (not (find (code-char 0) head)) "~A ~D: a NUL in the head" kind index)
            (is (every (lambda (position) (and (plusp position) (char= #\Return (char head (1- position)))))
                       (loop for position = (position #\Linefeed head) then (position #\Linefeed head :start (1+ position))
                             while position collect position))
                "~A ~D: a bare LF in the head" kind index)
            (is (not (cl-ppcre:scan (format nil "~C[^~C]" #\Return #\Linefeed) head))
                "~A ~D: a bare CR in the head" kind index))))
      (is (eql 200 (http-get server "/test/yo")) "the server goes on serving"))
    (let ((logged (uiop:read-file-string log)))
      (is (search "X-Echo was refused" logged) "the header's name is logged")
      (is (search "Set-Cookie was refused" logged))
      (is (search "Location was refused" logged))
      (is (not (search "Injected" logged)) "the value is never logged"))))

;;; Methods defined on the reply's header generic functions while serving:
;;; the engine sets and reads a reply's headers in its slot only while
;;; there are none (reply-headers.lisp).

(defvar *headers-set* '())

(defun yo-reply-text (server)
  "The whole reply SERVER sends for /test/yo, as a Latin-1 string."
  (with-connection (socket server)
    (send-text socket (get-request "/test/yo"))
    (read-whole-reply socket nil)))

(test replies.header-methods-defined-while-serving-are-called
  (with-server (server (make-server 'parallel-easy-acceptor))
    (is (search "Hey!" (yo-reply-text server)))
    (let ((setter (eval '(defmethod (setf ht:header-out) :after (value (name symbol) &optional reply)
                          (declare (ignore value reply))
                          (push name *headers-set*))))
          (reader (eval '(defmethod ht:headers-out :around ((reply ht:reply))
                          (if (hrt::headers-sent-p)
                              (acons :x-added "by a method" (call-next-method))
                              (call-next-method))))))
      (setf *headers-set* '())
      (unwind-protect
           (let ((reply (yo-reply-text server)))
             (is (search "X-Added: by a method" reply) "the reader's method: ~S" reply)
             (dolist (name '(:server :date :content-length))
               (is (member name *headers-set*) "~S set through (setf header-out): ~S" name *headers-set*))
             (let ((ours (count :content-type *headers-set*)))
               (setf *headers-set* '())
               (with-server (theirs (make-server 'ht:easy-acceptor))
                 (yo-reply-text theirs))
               ;; By the reply's initializer, the handler and the charset's addition.
               (is (= (count :content-type *headers-set*) ours)
                   "Content-Type set ~D times, on Hunchentoot's acceptor ~D" ours (count :content-type *headers-set*))))
        (remove-method #'(setf ht:header-out) setter)
        (remove-method #'ht:headers-out reader))
      (setf *headers-set* '())
      (let ((reply (yo-reply-text server)))
        (is (not (search "X-Added" reply)) "removed, the reader's method is not called")
        (is (search "Content-Length: 4" reply))
        (is (null *headers-set*) "removed, the setter's method is not called")))))

;;; Which road a reply takes: the engine's octets, or Hunchentoot's
;;; START-OUTPUT through the connection's stream.

(ht:define-easy-handler (test-page-with-session :uri "/test/page-with-session") ()
  (ht:start-session)
  (setf (ht:content-type*) "text/html")
  "<a href=\"/test/next\">next</a>")

(defun start-output-calls (server path &rest drakma-args)
  "GET PATH of SERVER: the status, the body, the headers and how many times
Hunchentoot's START-OUTPUT was called meanwhile."
  (let ((calls 0))
    (sb-int:encapsulate 'ht::start-output 'count-calls
                        (lambda (function &rest arguments)
                          (incf calls)
                          (apply function arguments)))
    (unwind-protect
         (multiple-value-bind (body status headers)
             (apply #'drakma:http-request (url server path) :connection-timeout 10 drakma-args)
           (values status body headers calls))
      (sb-int:unencapsulate 'ht::start-output 'count-calls))))

(test replies.each-kind-of-reply-takes-its-road
  "A string or octet body goes out as octets, with a session too, and with
the session's URL rewriting Hunchentoot applies to a client that sent no
cookie; replies a handler streams itself and bodiless ones go through
Hunchentoot's START-OUTPUT."
  (with-server (server (make-server 'parallel-easy-acceptor))
    (flet ((road (path &rest drakma-args)
             (multiple-value-bind (status body headers calls) (apply #'start-output-calls server path drakma-args)
               (declare (ignore headers))
               (is (eql 200 (if (eql status 304) 200 status)) "~A: ~A" path status)
               (values (if (zerop calls) :octets :stream) body))))
      (is (eq :octets (road "/test/yo")))
      (is (eq :octets (road "/test/octets")))
      (is (eq :stream (road "/test/chunked-reply")))
      (is (eq :stream (road "/test/not-modified"
                            :additional-headers '(("If-Modified-Since" . "Wed, 01 Jan 2020 00:00:00 GMT")))))
      ;; A session started, then presented in its cookie, then in the URL.
      (multiple-value-bind (status body headers calls) (start-output-calls server "/test/page-with-session")
        (declare (ignore body))
        (is (eql 200 status))
        (is (zerop calls) "the reply starting a session went through START-OUTPUT")
        (let* ((set-cookie (cdr (assoc :set-cookie headers)))
               (cookie (subseq set-cookie 0 (position #\; set-cookie)))
               (value (subseq cookie (1+ (position #\= cookie))))
               (id (subseq value 0 (position-if-not #'digit-char-p value))))
          (is (eq :octets (road "/test/page-with-session" :additional-headers `(("Cookie" . ,cookie)))))
          (multiple-value-bind (road body)
              ;; ID:STRING as it is: a colon may stand in a query, and
              ;; drakma would escape a %-escape again.
              (road (format nil "/test/page-with-session?hunchentoot-session=~A" value))
            (is (eq :octets road))
            (is (search (format nil "/test/next?hunchentoot-session=~A" id) body)
                "the links were not rewritten for the session: ~A" body)))))))
